"""The refresh policy: how often the refresh sensor asks for a drafter refresh (every N RL
steps), how many RL steps a refresh trains on (the window K), and when the drafter serving
now counts as stale (the ``serving_staleness`` check on ``serving_drafter``), and how many RL
steps of hidden-state shards storage keeps (``retain_steps``, applied by ``storage_retention``
after each refresh)."""


from dagster import ConfigurableResource
from pydantic import Field, model_validator

from resources.env import resource_from_env

_ENV = {"every": "AERIE_REFRESH_EVERY", "window": "AERIE_REFRESH_WINDOW",
        "stale_after_steps": "AERIE_STALE_AFTER_STEPS",
        "max_tau_drop_percent": "AERIE_MAX_TAU_DROP_PERCENT",
        "retain_steps": "AERIE_RETAIN_STEPS"}


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
        default=10, ge=0, description="serving_staleness warns when the serving drafter's last "
                                "measured τ is more than this many percent below its τ at "
                                "promotion")

    retain_steps: int = Field(
        default=0, ge=0, description="after each refresh, delete the hidden-state shards and "
                               "training work dirs of RL steps older than the newest this "
                               "many (never a step a queued or running refresh reads); 0 "
                               "keeps everything, else at least the window K")

    @model_validator(mode="after")
    def _retention_keeps_the_window(self) -> "RefreshPolicyResource":
        if 0 < self.retain_steps < self.window:
            raise ValueError(f"refresh policy: retain_steps {self.retain_steps} would delete "
                             f"steps the next refresh's window of {self.window} reads: set it "
                             f"to 0 (keep everything) or >= window")
        return self


def refresh_policy_from_env() -> RefreshPolicyResource:
    """Every field from its variable (``AERIE_REFRESH_EVERY``, ``AERIE_REFRESH_WINDOW``,
    ``AERIE_STALE_AFTER_STEPS``, ``AERIE_MAX_TAU_DROP_PERCENT``, ``AERIE_RETAIN_STEPS``) where
    it is set, checked now (the CLI builds the same policy)."""
    return resource_from_env(RefreshPolicyResource, "AERIE_", names=_ENV)

