"""The loop's chart: promotions and rollbacks read from the serving record, and a PNG with
every series drawn."""

from __future__ import annotations

from pipeline.monitor.chart import LoopEvent, loop_chart, loop_events, loop_figure
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

    # τ = tokens the verify passes emitted (all but the prefill token) / passes
    observed = [step(2, "1", 50, 101), step(3, "1", 50, 81), step(4, "2", 40, 97)]
    events = [LoopEvent(1, "promoted", "1"), LoopEvent(3, "promoted", "2"),
              LoopEvent(3, "rolled_back", "2")]
    fig = loop_figure(observed, {1: 2.1, 3: 2.3}, events, triggers={3: "drift"})
    (ax,) = fig.axes
    lines = {line.get_label(): line.get_xydata().tolist() for line in ax.lines
             if line.get_linestyle() != "--"}
    assert lines == {"observed, v1": [[2, 2.0], [3, 1.6]], "observed, v2": [[4, 2.4]]}
    (crosses,) = ax.collections
    assert crosses.get_offsets().tolist() == [[1, 2.1], [3, 2.3]]
    assert [t.get_text() for t in ax.texts if t.get_text() == "drift"] == ["drift"]
    marks = sorted((line.get_xdata()[0], line.get_color()) for line in ax.lines
                   if line.get_linestyle() == "--")
    assert marks == [(1, "#2ca02c"), (3, "#2ca02c"), (3, "#d62728")]
    assert ax.get_legend() is not None
    png = loop_chart(observed, {1: 2.1, 3: 2.3}, events)
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000


def test_nothing_observed_yet_draws_an_empty_frame():
    (ax,) = loop_figure([], {}, []).axes
    assert (len(ax.lines), len(ax.collections), ax.get_legend()) == (0, 0, None)
    assert ax.get_xlabel() == "RL step"


def test_a_loop_of_no_drafter_yet_draws_without_a_warning():
    """Before the first promotion every rollout is no drafter's (τ 1): the chart still has
    a range, and matplotlib has nothing to warn about (a newcomer reads warnings as errors)."""
    import warnings

    observed = [summarise(s, [{"drafter_version": "none", "verify_ct": 0,
                               "completion_tokens": 20}]) for s in (1, 2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig = loop_figure(observed, {}, [])
    (ax,) = fig.axes
    low, high = ax.get_ylim()
    assert low == 1.0 and high > low


def test_a_canary_is_one_event_when_it_starts_and_one_when_it_is_decided(tmp_path):
    d = Drafters(tmp_path, NAME)
    serving = d.manifest
    serving.apply(d.targets["1"], reason="promote v1")
    serving.start_canary(d.targets["2"], started_at=5, share=0.5, reason="canary v2")
    serving.apply(d.targets["2"], reason="canary v2 promoted")
    serving.start_canary(d.targets["3"], started_at=9, share=0.5, reason="canary v3")
    serving.restore(serving.current(), reason="canary v3 rolled back")
    assert loop_events(d.storage, NAME) == [
        LoopEvent(1, "promoted", "1"), LoopEvent(5, "canary", "2"),
        LoopEvent(5, "canary_promoted", "2"), LoopEvent(9, "canary", "3"),
        LoopEvent(9, "canary_rolled_back", "3")]
    observed = [summarise(s, [{"drafter_version": v, "verify_ct": 10,
                               "completion_tokens": 25} for v in ("1", "2")])
                for s in (5, 6, 7)]
    figure = loop_figure(observed, {}, loop_events(d.storage, NAME))
    texts = [t.get_text() for t in figure.axes[0].texts]
    assert "v2 promoted" in texts and "v3 rolled back" in texts
    assert "canary" in figure.axes[0].get_legend_handles_labels()[1]
