"""The refresh policy: how often the refresh sensor asks for a drafter refresh (every N RL
steps, stretched up to ``max_interval`` while the serving drafter's observed τ holds), how
many RL steps a refresh trains on (the window K), when the drafter serving now counts as
stale (the ``serving_staleness`` check on ``serving_drafter``) or drifted (the drift sensor:
its observed τ fell more than ``max_tau_drop_percent``), and how many RL steps of hidden-state
shards storage keeps (``retain_steps``, applied by ``storage_retention`` after each
refresh) and whether their policy checkpoints and ingestion runs go with them
(``prune_policies``, ``prune_history``)."""


from dagster import ConfigurableResource
from pydantic import Field, model_validator

from resources.env import resource_from_env

_ENV = {"every": "AERIE_REFRESH_EVERY", "window": "AERIE_REFRESH_WINDOW",
        "stale_after_steps": "AERIE_STALE_AFTER_STEPS",
        "max_tau_drop_percent": "AERIE_MAX_TAU_DROP_PERCENT",
        "retain_steps": "AERIE_RETAIN_STEPS", "prune_policies": "AERIE_PRUNE_POLICIES",
        "prune_history": "AERIE_PRUNE_HISTORY", "max_interval": "AERIE_REFRESH_MAX_INTERVAL",
        "drift_window": "AERIE_DRIFT_WINDOW", "drift_rearm_percent": "AERIE_DRIFT_REARM_PERCENT",
        "drift_cooldown_steps": "AERIE_DRIFT_COOLDOWN_STEPS",
        "drift_min_cycles": "AERIE_DRIFT_MIN_CYCLES"}


class RefreshPolicyResource(ConfigurableResource):
    """N and K of the refresh loop (the refresh at RL step s trains on s-K+1..s), and the
    staleness thresholds of the serving drafter."""

    every: int = Field(ge=1, default=4, description="N: refresh once per N ingested RL steps")
    window: int = Field(ge=1, default=4, description="K: RL steps a refresh trains on")
    stale_after_steps: int = Field(
        default=8, ge=0, description="serving_staleness warns when the newest ingested RL step is "
                               "more than this many steps past the end of the serving "
                               "drafter's training window")
    max_tau_drop_percent: int = Field(
        default=10, ge=0, lt=100, description="serving_staleness warns, and drift_sensor asks "
                                             "for a refresh, when the serving drafter's τ (last "
                                             "measured offline; observed by the RL engine) is "
                                             "more than this many percent below its τ at "
                                             "promotion")
    max_interval: int = Field(
        default=0, ge=0, description="while the serving drafter's observed τ has not fallen, "
                                     "refresh_sensor waits up to this many steps between "
                                     "refreshes instead of N; 0 keeps every N")
    drift_window: int = Field(default=2, ge=1, description="drift_sensor: RL steps of observed "
                                                            "acceptance summed per reading")
    drift_rearm_percent: int | None = Field(
        default=None, ge=0, description="drift_sensor: after a trigger, fires again only once "
                                        "the drop was back at or below this many percent (or "
                                        "another drafter serves); unset: half of "
                                        "max_tau_drop_percent")
    drift_cooldown_steps: int = Field(
        default=2, ge=0, description="drift_sensor: no trigger within this many RL steps of a "
                                     "refresh")
    drift_min_cycles: int = Field(
        default=50, ge=1, description="drift_sensor: verify passes a reading needs")

    retain_steps: int = Field(
        default=0, ge=0, description="after each refresh, delete the hidden-state shards and "
                               "training work dirs of RL steps older than the newest this "
                               "many (never a step a queued or running refresh reads); 0 "
                               "keeps everything, else at least the window K")
    prune_policies: bool = Field(
        default=False, description="retention also deletes the policy checkpoints of the "
                                   "ingested steps it deletes the shards of (a whole model "
                                   "per step); such a step can no longer be extracted again. "
                                   "Needs retain_steps > 0")
    prune_history: bool = Field(
        default=False, description="retention also deletes the finished ingestion runs "
                                   "(event and compute logs), the rl_steps partition keys and "
                                   "the loop charts of the steps it deletes the shards of; "
                                   "refresh runs stay. Needs retain_steps > 0")

    @model_validator(mode="after")
    def _retention_keeps_the_window(self) -> "RefreshPolicyResource":
        if 0 < self.retain_steps < self.window:
            raise ValueError(f"refresh policy: retain_steps {self.retain_steps} would delete "
                             f"steps the next refresh's window of {self.window} reads: set it "
                             f"to 0 (keep everything) or >= window")
        for name in ("prune_policies", "prune_history"):
            if getattr(self, name) and self.retain_steps == 0:
                raise ValueError(f"refresh policy: {name} needs retain_steps > 0 (which "
                                 "steps retention deletes)")
        if 0 < self.max_interval < self.every:
            raise ValueError(f"refresh policy: max_interval {self.max_interval} is below every "
                             f"{self.every}: set it to 0 (no stretching) or >= every")
        if self.drift_rearm_percent is not None and \
                self.drift_rearm_percent > self.max_tau_drop_percent:
            raise ValueError(f"refresh policy: drift_rearm_percent {self.drift_rearm_percent} "
                             f"is above max_tau_drop_percent {self.max_tau_drop_percent}: the "
                             f"trigger would re-arm while still drifted")
        return self

    def drift_policy(self):
        """The drift trigger's :class:`~pipeline.monitor.drift.DriftPolicy`."""
        from pipeline.monitor.drift import DriftPolicy

        rearm = self.drift_rearm_percent if self.drift_rearm_percent is not None else \
            self.max_tau_drop_percent / 2
        return DriftPolicy(max_drop=self.max_tau_drop_percent / 100, window=self.drift_window,
                           rearm_drop=rearm / 100,
                           cooldown_steps=self.drift_cooldown_steps,
                           min_cycles=self.drift_min_cycles)


def refresh_policy_from_env() -> RefreshPolicyResource:
    """Every field from its variable (``AERIE_REFRESH_EVERY``, ``AERIE_REFRESH_WINDOW``,
    ``AERIE_STALE_AFTER_STEPS``, ``AERIE_MAX_TAU_DROP_PERCENT``, ``AERIE_RETAIN_STEPS``,
    ``AERIE_PRUNE_POLICIES``, ``AERIE_PRUNE_HISTORY``, ``AERIE_REFRESH_MAX_INTERVAL``,
    ``AERIE_DRIFT_*``) where it is set, checked now (the CLI builds the same policy)."""
    return resource_from_env(RefreshPolicyResource, "AERIE_", names=_ENV)

