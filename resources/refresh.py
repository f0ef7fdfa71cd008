"""The refresh policy: how often the refresh sensor asks for a drafter refresh (every N RL
steps) and how many RL steps a refresh trains on (the window K)."""


import os

from dagster import ConfigurableResource, EnvVar, InitResourceContext
from pydantic import Field

_ENV = {"every": "AERIE_REFRESH_EVERY", "window": "AERIE_REFRESH_WINDOW"}


class RefreshPolicyResource(ConfigurableResource):
    """N and K of the refresh loop (the refresh at RL step s trains on s-K+1..s)."""

    every: int = Field(default=4, description="N: refresh once per N ingested RL steps")
    window: int = Field(default=4, description="K: RL steps a refresh trains on")

    def setup_for_execution(self, context: InitResourceContext) -> None:
        for name in _ENV:  # checked here: EnvVar values only exist once resolved
            if getattr(self, name) < 1:
                raise ValueError(f"refresh policy: {name} must be >= 1, got "
                                 f"{getattr(self, name)}")


def refresh_policy_from_env() -> RefreshPolicyResource:
    """N and K from ``AERIE_REFRESH_EVERY`` / ``AERIE_REFRESH_WINDOW`` where they are set."""
    return RefreshPolicyResource(**{f: EnvVar.int(v) for f, v in _ENV.items()
                                    if v in os.environ})
