"""The serving resource: which serving mode promotes drafters, its parameters, and how a
promotion is verified afterwards (``verify*``; ``server_urls`` are the servers probed in the
SGLang modes, see :mod:`pipeline.monitor.verify`).

Modes (see :mod:`pipeline.release.backend`):

- ``manifest`` (default): publish ``serving/<name>/current.json`` in storage; the RL trainer's
  rollout launcher reads it at weight sync (:func:`pipeline.serving_now.resolve_serving`).
- ``sglang-restart``: also run ``restart_command`` (argv list, no shell; placeholders
  ``{drafter_dir} {num_steps} {topk} {num_draft_tokens} {registry_version} {fingerprint}``).
- ``vllm-restart``: ``restart_command`` restarts vLLM; ``{speculative_config}`` is vLLM's
  ``--speculative-config`` JSON for the drafter.
- ``vllm-reload``: loads the drafter's weights into the running vLLM servers at
  ``server_urls`` (dev mode, Aerie's worker extension; see
  :mod:`pipeline.release.vllm_reload`).
"""


from pathlib import Path
from typing import Literal

from dagster import ConfigurableResource
from pydantic import Field

from pipeline.eagle3.spec import SpecParams
from pipeline.release.actuators import MODES, ActuatorSettings, actuator_factory
from pipeline.release.backend import LedgerBackend
from pipeline.release.ledger import ServingLedger
from pipeline.storage import Storage
from resources.env import resource_from_env
from resources.home import aerie_home

Mode = Literal[MODES]  # the actuators' registry: config offers exactly those


class ServingResource(ConfigurableResource):
    """How promoted drafters reach the rollout servers."""

    mode: Mode = Field(default="manifest", description="how a promoted drafter reaches the "
                                                       "servers (docs/concepts/promotion.md, "
                                                       "Serving modes)")
    num_steps: int = Field(default=3, ge=1, description="--speculative-num-steps")
    topk: int = Field(default=1, ge=1, description="--speculative-eagle-topk")
    num_draft_tokens: int = Field(default=4, ge=2, description="--speculative-num-draft-"
                                                               "tokens (num_steps + 1 when "
                                                               "topk is 1)")
    restart_command: list[str] = Field(
        default_factory=list, description="sglang-restart/vllm-restart: argv of the restart "
                                          "hook")
    no_drafter_command: list[str] = Field(
        default_factory=list, description="sglang-restart/vllm-restart: argv that restarts "
                                          "the engine without a drafter (used to undo a first "
                                          "promotion)")
    restart_timeout_s: float = Field(default=900.0, gt=0, description="sglang-restart/vllm-"
                                                                      "restart: hook timeout")
    server_urls: list[str] = Field(
        default_factory=list, description="base URLs of the servers: vllm-reload loads "
                                          "drafters into them; in the sglang modes the "
                                          "post-promotion check probes them")
    reload_timeout_s: float = Field(default=120.0, gt=0, description="vllm-reload: per "
                                                                     "request")
    verify: Literal["auto", "off"] = Field(
        default="auto", description="after a promotion, check that the servers draft as well "
                                    "as the gate measured (below the floor: roll back): live "
                                    "on server_urls in the sglang modes, else from the "
                                    "acceptance the RL engine reports; off: never")
    api_key: str | None = Field(
        default=None, description="the servers' --api-key, for the post-promotion probe "
                                  "(a secret: set AERIE_SERVING_API_KEY, read as an EnvVar)")
    verify_min_tau: float = Field(default=1.1, ge=1.0, description="verification floor: "
                                                                   "absolute τ")
    verify_min_share: float = Field(default=0.8, ge=0.0, le=1.0,
                                    description="verification floor: share of the gated τ")
    verify_min_cycles: int = Field(default=20, ge=1, description="verification: verify "
                                                                 "passes before a verdict")
    verify_min_samples: int = Field(default=5, ge=1, description="verification: prompts (live) "
                                                                 "or rollouts (reported) "
                                                                 "before a verdict")
    cache_dir: str | None = Field(
        default=None, description="local drafter copies for restart/reload; unset: "
                                  "$AERIE_HOME/serving-cache")
    canary_share: float = Field(
        default=0.0, ge=0.0, lt=1.0, description="a drafter the gate passes first serves this "
                                                 "share of the rollout servers (a canary) "
                                                 "beside the champion; 0: every server at "
                                                 "once (docs/concepts/promotion.md, Canaries)")
    canary_servers: list[str] = Field(
        default_factory=list, description="the servers a canary serves, by name (server_urls "
                                          "in vllm-reload and restart modes with {server}, "
                                          "the launcher's names in manifest mode); instead of "
                                          "canary_share")
    canary_steps: int = Field(default=4, ge=1, description="canary: RL steps with both "
                                                           "drafters drafting before a verdict")
    canary_min_verify_passes: int = Field(default=200, ge=1, description="canary: verify "
                                                                         "passes per drafter "
                                                                         "before a verdict")
    canary_min_rollouts: int = Field(default=2, ge=1, description="canary: rollouts per "
                                                                  "drafter for a step to "
                                                                  "count")
    canary_min_gain: float = Field(default=0.0, description="canary: the lower end of the "
                                                            "95% interval of its τ gain over "
                                                            "the champion must exceed this")

    def settings(self) -> SpecParams:
        return SpecParams(num_steps=self.num_steps, eagle_topk=self.topk,
                          num_draft_tokens=self.num_draft_tokens)

    def verify_policy(self):
        """The post-promotion check's :class:`~pipeline.monitor.verify.VerifyPolicy`."""
        from pipeline.monitor.verify import VerifyPolicy

        return VerifyPolicy(min_tau=self.verify_min_tau, min_share=self.verify_min_share,
                            min_cycles=self.verify_min_cycles,
                            min_samples=self.verify_min_samples)

    def canary_plan(self):
        """Where the gate's next drafter serves first
        (:class:`~pipeline.release.canary.CanaryPlan`; not enabled: every server at once)."""
        from pipeline.release.canary import CanaryPlan

        return CanaryPlan(share=self.canary_share, servers=tuple(self.canary_servers))

    def canary_policy(self):
        """How a canary is judged (:class:`~pipeline.monitor.canary.CanaryPolicy`)."""
        from pipeline.monitor.canary import CanaryPolicy

        return CanaryPolicy(canary_steps=self.canary_steps,
                            min_verify_passes=self.canary_min_verify_passes,
                            min_rollouts=self.canary_min_rollouts,
                            min_relative_gain=self.canary_min_gain)

    def verification(self) -> Literal["live", "reported", "off"]:
        """How promotions are verified (:func:`pipeline.monitor.stage.after_promotion`): on
        the live servers (SGLang modes with ``server_urls``), from what the RL engine
        reports in the next RL steps, or not at all."""
        if self.verify == "off":
            return "off"
        live = self.mode.startswith("sglang") and bool(self.server_urls)
        return "live" if live else "reported"

    def build(self, storage: Storage, name: str) -> LedgerBackend:
        """The backend that serves drafters of ``name`` (the registered model name)."""
        settings = self.settings()
        ledger = ServingLedger(storage, name)
        factory = actuator_factory(self.mode, ActuatorSettings(
            restart_command=tuple(self.restart_command),
            no_drafter_command=tuple(self.no_drafter_command),
            restart_timeout_s=self.restart_timeout_s, server_urls=tuple(self.server_urls),
            reload_timeout_s=self.reload_timeout_s))
        if factory is None:
            return LedgerBackend(ledger, settings)
        cache = Path(self.cache_dir) if self.cache_dir else aerie_home() / "serving-cache"
        return LedgerBackend(ledger, settings, factory(settings), cache_dir=cache)


def serving_kind(mode: str) -> str:
    """The engine a serving mode hands drafters to (``sglang``, ``vllm``), or ``manifest``:
    the kind the serving assets show in the UI."""
    return mode.split("-", 1)[0]


def serving_from_env() -> ServingResource:
    """Every field from ``AERIE_SERVING_<FIELD>`` where it is set (commands and URLs as JSON
    lists, URLs also comma-separated; the API key as an ``EnvVar``)."""
    return resource_from_env(ServingResource, "AERIE_SERVING_", secrets=("api_key",))
