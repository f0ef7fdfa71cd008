"""The evaluator resource: who measures τ in ``acceptance_eval`` (and ``aerie eval``).

``kind`` is one of the evaluators' registry (``pipeline.evaluation.evaluators``):
``inprocess`` (Aerie's own engine, the default), ``sglang`` or ``vllm`` (a server of that
engine per contestant, started from the section's ``launch``; docs/concepts/acceptance.md,
"The engine as judge"). An engine kind has a typed section of the same name.
"""

from typing import Literal

from dagster import Config, ConfigurableResource, Failure, InitResourceContext
from pydantic import Field

from pipeline.evaluation.evaluators import EVALUATORS, Evaluator
from pipeline.evaluation.servers import PLACEHOLDERS, EngineServers
from resources.env import resource_from_env

WHERE = "resources.evaluator.config"
_S = EngineServers()


class EngineServersConfig(Config):
    """How an engine evaluator starts a server per contestant (candidate, champion, no
    drafter) on the refresh step's policy."""

    launch: list[str] = Field(
        default_factory=list,
        description="argv template of one server, no shell; placeholders "
                    + " ".join(f"{{{p}}}" for p in sorted(PLACEHOLDERS))
                    + " ({speculative_args} alone as one item: the drafter's flags, none for "
                      "no drafter); tensor/expert parallel and other flags are yours; no "
                      "secrets here (the UI shows it): the servers inherit the environment")
    host: str = Field(default=_S.host, description="where the servers listen and are reached")
    health_timeout_s: float = Field(default=_S.health_timeout_s, gt=0,
                                    description="seconds a server may take to be healthy")
    request_timeout_s: float = Field(default=_S.request_timeout_s, gt=0,
                                     description="seconds per request")
    concurrency: int = Field(default=_S.concurrency, ge=1,
                             description="requests in flight at once")
    log_dir: str | None = Field(default=None, description="keep each server's output here "
                                                          "(unset: a temporary directory)")
    tie_nats: float = Field(default=_S.tie_nats, ge=0,
                            description="a greedy divergence at the no-drafter server's top "
                                        "two tokens this close in log-probability is a "
                                        "near-tie, not a failure (0: none is)")

    def to_core(self) -> EngineServers:
        return EngineServers(launch=tuple(self.launch), host=self.host,
                             health_timeout_s=self.health_timeout_s,
                             request_timeout_s=self.request_timeout_s,
                             concurrency=self.concurrency, log_dir=self.log_dir,
                             tie_nats=self.tie_nats)


class EvaluatorResource(ConfigurableResource):
    """Who measures the contestants of an acceptance evaluation."""

    kind: Literal[tuple(EVALUATORS)] = Field(  # type: ignore[valid-type]
        default="inprocess", description="inprocess: Aerie's engine on one device; sglang or "
                                         "vllm: the engine's servers started from the "
                                         "section's launch, judged by their own counters")
    sglang: EngineServersConfig = Field(default_factory=EngineServersConfig,
                                        description="the sglang evaluator's servers")
    vllm: EngineServersConfig = Field(default_factory=EngineServersConfig,
                                      description="the vllm evaluator's servers ({speculative_"
                                                  "args}: --speculative-config and "
                                                  "--per-request-spec-decode-metrics)")

    def setup_for_execution(self, context: InitResourceContext) -> None:
        problem = self.problem()
        if problem:
            raise Failure(description=problem, allow_retries=False)

    def problem(self) -> str | None:
        """What is wrong with the configuration, with the fix; None when nothing is."""
        try:
            self.build()
        except ValueError as e:
            return (f"{WHERE}: {e}; e.g. sglang.launch: [\"python\", \"-m\", "
                    f"\"sglang.launch_server\", \"--model-path\", \"{{policy_dir}}\", "
                    f"\"--port\", \"{{port}}\", \"--tp-size\", \"8\", \"{{speculative_args}}\"]")
        return None

    def build(self) -> Evaluator:
        if not EVALUATORS[self.kind].engine:
            return Evaluator(self.kind)
        return Evaluator(self.kind, getattr(self, self.kind).to_core())


def evaluator_from_env() -> EvaluatorResource:
    """``AERIE_EVALUATOR_KIND`` and a section's fields from ``AERIE_EVALUATOR_<SECTION>_<FIELD>``
    (``AERIE_EVALUATOR_SGLANG_LAUNCH`` as a JSON list) where they are set."""
    return resource_from_env(EvaluatorResource, "AERIE_EVALUATOR_")
