"""The loop's chart: promotions and rollbacks read from the serving record, and a PNG with
every series drawn."""

from __future__ import annotations

from pipeline.monitor.chart import LoopEvent, loop_chart, loop_events
from pipeline.monitor.observed import summarise
from tests.release.helpers import Drafters

NAME = "aerie-drafter-chart"


def test_events_follow_the_serving_record(tmp_path):
    d = Drafters(tmp_path, NAME)
    serving = d.manifest
    serving.apply(d.targets["1"], reason="promote v1")
    serving.apply(d.targets["2"], reason="promote v2")
    serving.apply(d.targets["1"], reason="rollback v2 -> 1")  # what rollback() writes
    serving.apply(d.targets["3"], reason="promote v3")
    serving.restore(None, reason="undo: no drafter")
    assert loop_events(d.storage, NAME) == [
        LoopEvent(1, "promoted", "1"), LoopEvent(2, "promoted", "2"),
        LoopEvent(2, "rolled_back", "2"), LoopEvent(3, "promoted", "3"),
        LoopEvent(3, "rolled_back", "3")]


def test_the_chart_draws_observed_offline_and_events():
    def step(s, version, verify, completion):
        return summarise(s, [{"drafter_version": version, "verify_ct": verify,
                              "completion_tokens": completion}])

    observed = [step(2, "1", 50, 101), step(3, "1", 50, 81), step(4, "2", 40, 97)]
    png = loop_chart(observed, {1: 2.1, 3: 2.3}, [LoopEvent(1, "promoted", "1"),
                                                  LoopEvent(3, "promoted", "2")])
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert loop_chart([], {}, []).startswith(b"\x89PNG")  # nothing yet: an empty frame
