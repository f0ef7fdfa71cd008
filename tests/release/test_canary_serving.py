"""What each rollout server serves while a canary runs (the serving record's view), and the
actuators' server subsets; no server, no subprocess."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipeline.eagle3.spec import SpecParams
from pipeline.records import RecordError, from_json, to_json
from pipeline.release.canary import CanaryPlan
from pipeline.release.vllm_reload import VllmDraftReload
from pipeline.serving_now import (
    CANARY_SCHEMA_VERSION,
    Canary,
    ServingManifest,
    ServingTarget,
    canary_servers,
)

SETTINGS = SpecParams(3, 1, 4)


def target(version: str) -> ServingTarget:
    return ServingTarget(f"drafters/step={version}", f"fp{version}", "m", version)


def canary(**kw) -> Canary:
    return Canary(target("2"), SpecParams(5, 1, 6), ("--x", "{drafter_dir}"), "eagle3", 21,
                  **kw)


def manifest(c: Canary | None) -> ServingManifest:
    return ServingManifest("m", 3, "manifest", target("1"), SETTINGS, ("--y",),
                           "2026-12-03T00:00:00", canary=c,
                           schema_version=CANARY_SCHEMA_VERSION if c else 2)


@pytest.mark.parametrize("fleet, share, expected", [
    (("b", "a", "d", "c"), 0.5, ("a", "b")),  # sorted, so every reader agrees
    (("a", "b", "c"), 0.1, ("a",)),  # at least one
    (("a", "b", "c"), 0.9, ("a", "b")),  # never all: the champion keeps one
    (("a",), 0.5, ()),  # one server cannot split
])
def test_a_share_picks_the_same_servers_for_every_reader(fleet, share, expected):
    assert canary_servers(canary(share=share), fleet) == expected


def test_named_servers_serve_it_where_they_are_in_the_fleet():
    c = canary(servers=("b", "z"))
    assert canary_servers(c, ("a", "b", "c")) == ("b",)
    with pytest.raises(ValueError, match="servers or a share"):
        canary()


def test_each_server_sees_one_drafter_and_the_record_round_trips():
    m = manifest(canary(share=0.5))
    fleet = ("s0", "s1", "s2", "s3")
    on = m.on("s0", fleet)
    assert (on.target, on.settings, on.sglang_args, on.canary) == (
        target("2"), SpecParams(5, 1, 6), ("--x", "{drafter_dir}"), None)
    assert m.on("s3", fleet) == replace(m, canary=None)
    assert manifest(None).on("s0", fleet) == manifest(None)
    back = from_json(ServingManifest, to_json(m))
    assert back == m and back.canary.started_at == 21


def test_a_reader_of_an_older_schema_refuses_a_canary_rather_than_serve_around_it():
    class OldReader(ServingManifest):
        READABLE_SCHEMA_VERSIONS = (1, 2)

    assert from_json(OldReader, to_json(manifest(None))).canary is None
    with pytest.raises(RecordError, match="schema_version 3"):
        from_json(OldReader, to_json(manifest(canary(share=0.5))))


def test_vllm_reload_addresses_the_servers_it_is_given():
    reload = VllmDraftReload(["http://127.0.0.1:1", "http://127.0.0.1:2/"], SETTINGS)
    part = reload.on(("http://127.0.0.1:2/",))
    assert part.servers == ("http://127.0.0.1:2/",)
    assert [c.base_url for c in part.clients] == ["http://127.0.0.1:2"]
    assert len(reload.clients) == 2  # the whole one is unchanged


def test_a_canary_plan_needs_a_share_below_one_or_servers():
    assert not CanaryPlan().enabled and CanaryPlan(servers=("a",)).enabled
    with pytest.raises(ValueError, match="canary_share"):
        CanaryPlan(share=1.0)
