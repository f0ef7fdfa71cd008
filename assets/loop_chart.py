"""The loop's chart: τ observed over RL steps, offline τ at each refresh, promotions and
rollbacks, stored beside an RL step's observed acceptance. ``serving_acceptance`` draws it
every RL step and ``serving_drafter`` logs it to the promoted drafter's MLflow run."""

from assets.partitions import refresh_triggers

LOOP_CHART = "tau_over_rl_steps"
CHART_STEPS = 200  # RL steps the loop chart shows, up to the newest


def publish_loop_chart(store, name: str, step: int, instance=None) -> str:
    """Draw the loop's chart of the last :data:`CHART_STEPS` RL steps up to ``step`` (with
    what triggered each refresh, from ``instance``'s runs) and store it beside the step's
    observed acceptance; returns its storage key."""
    from pipeline.evaluation.stage import tau_history
    from pipeline.layout import observed_key
    from pipeline.monitor.chart import loop_chart, loop_events
    from pipeline.monitor.observed import observed_series

    first = max(0, step - CHART_STEPS + 1)
    shown = range(first, step + 1)
    series = [o for o in observed_series(store, since=first) if o.step in shown]
    offline = tau_history(store).get("candidate", {})
    png = loop_chart(series, {s: t for s, t in offline.items() if s in shown},
                     [e for e in loop_events(store, name) if e.step in shown],
                     title=f"{name}: τ over RL steps (to step {step})",
                     triggers=refresh_triggers(instance) if instance is not None else None)
    key = observed_key(step).rsplit("/", 1)[0] + f"/{LOOP_CHART}.png"
    store.write_bytes(key, png)
    return key
