"""The serving resource: which serving mode promotes drafters, and its parameters.

Modes (see :mod:`pipeline.release.backend`):

- ``manifest`` (default): publish ``serving/<name>/current.json`` in storage; the RL trainer's
  rollout launcher reads it at weight sync (:func:`pipeline.serving_now.resolve_serving`).
- ``sglang-restart``: also run ``restart_command`` (argv list, no shell; placeholders
  ``{drafter_dir} {num_steps} {topk} {num_draft_tokens} {registry_version} {fingerprint}``).
- ``sglang-hotswap``: also swap draft weights in ``server_urls`` in place. Aerie ships no
  payload encoder for SGLang's pickle-based ``/update_weights_from_tensor``, so this mode
  checks compatibility and then refuses with an explanation (see
  :mod:`pipeline.release.hotswap`).
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
from pipeline.release.backend import MODES, LedgerBackend
from pipeline.release.ledger import ServingLedger
from pipeline.storage import Storage
from resources.env import resource_from_env
from resources.home import aerie_home

Mode = Literal["manifest", "sglang-restart", "sglang-hotswap", "vllm-restart", "vllm-reload"]


class ServingResource(ConfigurableResource):
    """How promoted drafters reach the rollout servers."""

    mode: Mode = Field(default="manifest", description="how a promoted drafter reaches the "
                                                       "servers (see the README, Serving)")
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
        default_factory=list, description="sglang-hotswap/vllm-reload: base URLs of the "
                                          "servers")
    hotswap_timeout_s: float = Field(default=120.0, gt=0, description="sglang-hotswap/vllm-"
                                                                      "reload: per request")
    cache_dir: str | None = Field(
        default=None, description="local drafter copies for restart/hotswap; unset: "
                                  "$AERIE_HOME/serving-cache")

    def settings(self) -> SpecParams:
        return SpecParams(num_steps=self.num_steps, eagle_topk=self.topk,
                          num_draft_tokens=self.num_draft_tokens)

    def build(self, storage: Storage, name: str) -> LedgerBackend:
        """The backend that serves drafters of ``name`` (the registered model name)."""
        if self.mode not in MODES:
            raise ValueError(f"serving mode {self.mode!r} is not one of {MODES}")
        settings = self.settings()
        ledger = ServingLedger(storage, name)
        if self.mode == "manifest":
            return LedgerBackend(ledger, settings)
        cache = Path(self.cache_dir) if self.cache_dir else aerie_home() / "serving-cache"
        if self.mode in ("sglang-restart", "vllm-restart"):
            from pipeline.release.restart import RestartHook  # torch: only when used

            if not self.restart_command:
                raise ValueError(f"serving mode {self.mode} needs restart_command")
            actuator = RestartHook(self.restart_command, settings,
                                   timeout_s=self.restart_timeout_s,
                                   no_drafter_argv=self.no_drafter_command or None,
                                   mode=self.mode)
        elif self.mode == "vllm-reload":
            from pipeline.release.vllm_reload import VllmDraftReload  # torch: only when used

            actuator = VllmDraftReload(self.server_urls, settings,
                                       timeout_s=self.hotswap_timeout_s)
        else:
            from pipeline.release.hotswap import SglangHotswap  # torch: only when used

            actuator = SglangHotswap(self.server_urls, timeout_s=self.hotswap_timeout_s)
        return LedgerBackend(ledger, settings, actuator, cache_dir=cache)


def serving_from_env() -> ServingResource:
    """Every field from ``AERIE_SERVING_<FIELD>`` where it is set (commands and URLs as JSON
    lists, URLs also comma-separated)."""
    return resource_from_env(ServingResource, "AERIE_SERVING_")
