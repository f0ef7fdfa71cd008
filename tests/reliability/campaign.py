"""The fault campaign: each stage that talks to a service, run through a
:class:`~tests.reliability.fault_proxy.FaultProxy` while the proxy (or a restart of the
service) misbehaves, and what came of it.

A case is one scenario (a stage against one service) under one fault. It runs like this:

1. the scenario prepares fresh state (its own bucket, registered model, lease, step);
2. the fault is set and the stage runs, watched: past ``hang_s`` it is *hung* (the proxy's
   links are then reset so the stage can fail and the case end);
3. a stage that failed is checked for anything committed partially, then the fault ends
   (the network came back, the service is up) and the stage runs again: the retry Dagster's
   policy makes for a transient error, the next run for a permanent one;
4. the scenario checks what must hold once it completed: nothing lost, nothing twice, no
   lock or lease left held.

Outcomes: ``completed`` (on the first attempt: the client's own retries or patience were
enough), ``retried`` (a transient, named error that Dagster retries, then completed),
``permanent`` (an error no retry fixes, and the next run completed), ``hung``. A case
*holds* when no problem was found. Problems: it hung; its error was not a named one (Aerie's
own, or the service client's: see :func:`named`) but, say, an ``AttributeError``; its error
was permanent although every fault here passes (Dagster would not have retried it); a proxy
fault never reached the stage (the case tested nothing); something was committed partially,
lost, doubled or left held. The docs' fault table is :func:`markdown_table` of a full run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from assets.retry import is_permanent
from tests.reliability.fault_proxy import Fault, FaultProxy

RESTART = "restart"
DISK_FULL = "disk full"
MID_RUN_S = 0.5  # a "mid-run" fault starts this long after the stage, on its open connections
FAULTS: dict[str, Fault | str] = {
    "latency 50 ms": Fault("latency", delay_s=0.05),
    "reset once": Fault("reset", count=1),
    "resets": Fault("reset"),
    "resets mid-run": Fault("reset"),
    "black hole": Fault("blackhole"),
    "black hole mid-run": Fault("blackhole"),
    "truncated once": Fault("truncate", after_bytes=100, count=1),
    "slow 64 KiB/s": Fault("slow", rate=65536),
    "refused": Fault("refuse"),
    "service restarted": RESTART,
    "storage root fills up": DISK_FULL,
}
# what CI runs: every fault class at least once, and every service under a black hole (the
# costliest fault: it lasts the scenario's whole bound) and a reset mid-run or a restart
SAMPLE = {
    "s3": ("black hole", "truncated once"),
    "mlflow": ("black hole", "service restarted"),
    "postgres": ("black hole mid-run", "service restarted", "refused"),
    "sglang": ("resets mid-run", "black hole mid-run"),
    "vllm": ("black hole mid-run", "truncated once"),
    "disk": ("storage root fills up",),
}


class Scenario:
    """One stage against one service. ``proxies`` stand in front of the service (one per
    address the stage talks to); the stage must reach it only through them."""

    service = ""
    stage = ""
    restartable = True
    proxies: Sequence[FaultProxy] = ()

    def prepare(self) -> None:
        """Fresh state for one case (nothing of an earlier case can make it pass)."""

    def run(self) -> None:
        """The stage, as Dagster would run it (a fresh client per attempt)."""
        raise NotImplementedError

    def partial(self) -> list[str]:
        """After a failed attempt: what was committed partially (should be nothing)."""
        return []

    def settled(self) -> list[str]:
        """After the attempt that completed: what is lost, doubled or still held."""
        return []

    restart_after_s = MID_RUN_S
    down_s = 1.0

    def supports(self, fault_name: str) -> bool:
        fault = FAULTS[fault_name]
        if fault == RESTART:
            return self.restartable
        if fault == DISK_FULL:
            return False
        return bool(self.proxies)

    def fill_disk(self) -> None:
        """Fill the storage root's filesystem (all but a little of it)."""
        raise NotImplementedError

    def free_disk(self) -> None:
        raise NotImplementedError

    def stop_service(self) -> None:
        raise NotImplementedError

    def start_service(self) -> None:
        """Start the service again on the same port (and its data)."""
        raise NotImplementedError


@dataclass
class Outcome:
    service: str
    stage: str
    fault: str
    outcome: str  # completed | retried | permanent | hung
    error: str = ""  # the first failed attempt's error: "Class: first line"
    seconds_to_complete: float = float("nan")  # from the fault's start to completion
    hit: int = 0  # connections the fault reached
    problems: list[str] = field(default_factory=list)

    @property
    def holds(self) -> bool:
        return self.outcome != "hung" and not self.problems

    def row(self) -> str:
        error = self.error.replace("|", "\\|")
        t = "-" if self.seconds_to_complete != self.seconds_to_complete else \
            f"{self.seconds_to_complete:.1f}"
        problems = "; ".join(self.problems) or "none"
        return (f"| {self.service} | {self.stage} | {self.fault} | {self.outcome} | {error} | "
                f"{self.hit} | {t} | {problems} |")


@dataclass
class _Attempt:
    error: BaseException | None = None
    hung: bool = False


def _watched(fn: Callable[[], None], hang_s: float, on_hang: Callable[[], None]) -> _Attempt:
    result = _Attempt()

    def body() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - the campaign records every outcome
            result.error = e

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(hang_s)
    if thread.is_alive():
        result.hung = True
        on_hang()  # reset every link so that the stage fails and the thread ends
        thread.join(60)
    return result


# where a named error comes from: Aerie's core, and the clients of the services it talks to
NAMED_ORIGINS = ("pipeline.", "botocore.", "aiobotocore.", "aiohttp.", "fsspec.", "s3fs.",
                 "mlflow.", "psycopg2.", "requests.", "urllib3.")


def named(error: BaseException) -> bool:
    """The error says what failed: one of Aerie's, a service client's, or a builtin I/O
    error (``ConnectionError``, ``TimeoutError``: ``OSError``s name the call)."""
    module = type(error).__module__ + "."
    return module.startswith(NAMED_ORIGINS) or type(error) in (ConnectionResetError,
                                                                ConnectionRefusedError,
                                                                TimeoutError)


def describe(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(error).__name__}: {first[:90]}"


def run_case(scenario: Scenario, fault_name: str, *, hang_s: float = 60.0) -> Outcome:
    fault = FAULTS[fault_name]
    scenario.prepare()
    proxy = _All(scenario.proxies)
    outcome = Outcome(scenario.service, scenario.stage, fault_name, "completed")
    start = time.monotonic()
    restarter = None
    if fault == RESTART:
        restarter = threading.Thread(target=_restart, args=(scenario,), daemon=True)
    elif fault == DISK_FULL:
        scenario.fill_disk()
    elif fault_name.endswith("mid-run"):
        restarter = threading.Timer(MID_RUN_S, proxy.set, args=(fault,))
    else:
        proxy.set(fault)
    if restarter is not None:
        restarter.start()
    first = _watched(scenario.run, hang_s, lambda: proxy.set(Fault("reset")))
    if restarter is not None:
        restarter.join()
    proxy.clear()
    if fault == DISK_FULL:
        scenario.free_disk()
    outcome.hit = proxy.hit()
    if first.hung:
        outcome.outcome, outcome.error = "hung", f"no answer in {hang_s:g} s"
    elif first.error is not None:
        outcome.outcome = "permanent" if is_permanent(first.error) else "retried"
        outcome.error = describe(first.error)
        if not named(first.error):
            outcome.problems.append(f"an unnamed error: {outcome.error}")
        if outcome.outcome == "permanent":
            outcome.problems.append("a passing fault ended in an error Dagster does not retry")
    reaches = isinstance(fault, Fault) and fault.kind != "refuse"  # refusing has no links
    if reaches and outcome.hit == 0:
        outcome.problems.append("the fault never reached the stage: the case tested nothing")
    if first.hung or first.error is not None:
        outcome.problems += [f"after the failed attempt: {p}" for p in scenario.partial()]
        second = _watched(scenario.run, hang_s, lambda: proxy.set(Fault("reset")))
        proxy.clear()
        if second.error is not None or second.hung:
            why = "hung" if second.hung else describe(second.error)
            outcome.problems.append(f"the run after the fault ended failed too: {why}")
            return outcome
    outcome.seconds_to_complete = time.monotonic() - start
    outcome.problems += scenario.settled()
    return outcome


class _All:
    """The scenario's proxies, driven as one."""

    def __init__(self, proxies: Sequence[FaultProxy]):
        self.proxies = list(proxies)
        for p in self.proxies:
            p.stats.clear()

    def set(self, fault: Fault) -> None:
        for p in self.proxies:
            p.set(fault)

    def clear(self) -> None:
        for p in self.proxies:
            p.clear()

    def hit(self) -> int:
        return sum(sum(p.stats.values()) for p in self.proxies)


def _restart(scenario: Scenario) -> None:
    """The service goes down ``restart_after_s`` into the stage, and comes back after
    ``down_s``."""
    time.sleep(scenario.restart_after_s)
    scenario.stop_service()
    time.sleep(scenario.down_s)
    scenario.start_service()


def run_campaign(scenarios: Sequence[Scenario], faults: Sequence[str], *,
                 hang_s: float = 60.0) -> list[Outcome]:
    return [run_case(s, f, hang_s=hang_s) for s in scenarios for f in faults if s.supports(f)]


HEADER = ("| service | stage | fault | outcome | first error | connections hit | "
          "s to complete | problems |\n|---|---|---|---|---|---|---|---|")


def markdown_table(outcomes: Sequence[Outcome]) -> str:
    return "\n".join([HEADER, *(o.row() for o in outcomes)])
