"""When the serving drafter has gone stale by the numbers: the drift trigger's decision.

The drift sensor asks for a refresh when the τ the RL engine observed with the serving drafter
(:mod:`.observed`, summed over the last ``window`` RL steps that drafter drafted) fell more
than ``max_drop`` below its τ at promotion (the gate's offline τ of that drafter). The cadence
sensor asks :func:`healthy` whether it may wait up to ``max_interval`` steps instead of N.

Exactly once per drop: a trigger disarms the sensor until the observed τ is back within
``rearm_drop`` of the reference (hysteresis) or another drafter serves (a new reference);
``cooldown_steps`` after any refresh no trigger fires (the refresh's effect is not observed
yet). A window with fewer than ``min_cycles`` verify passes decides nothing. Without its
cursor, the sensor rebuilds the state from the run that fired last for the drafter and the
readings since (:meth:`Watch.recovered_after`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.monitor.observed import StepAcceptance


@dataclass(frozen=True)
class DriftPolicy:
    max_drop: float = 0.10  # share of the τ at promotion
    window: int = 2  # RL steps summed
    rearm_drop: float = 0.05  # re-armed once the drop is back at or below this share
    cooldown_steps: int = 2  # RL steps after a refresh without a trigger
    min_cycles: int = 50  # verify passes a window needs to count

    def __post_init__(self) -> None:
        if not 0 <= self.rearm_drop <= self.max_drop < 1:
            raise ValueError(f"drift policy: need 0 <= rearm_drop <= max_drop < 1, got "
                             f"{self.rearm_drop} and {self.max_drop}")
        if self.window < 1 or self.cooldown_steps < 0 or self.min_cycles < 1:
            raise ValueError("drift policy: window >= 1, cooldown_steps >= 0, min_cycles >= 1")


@dataclass(frozen=True)
class Reading:
    """The serving drafter's observed τ over its last window of RL steps."""

    version: str
    reference: float  # its τ at promotion
    steps: tuple[int, ...]  # the RL steps summed (it drafted in each)
    emitted: int
    cycles: int

    @property
    def tau(self) -> float | None:
        return self.emitted / self.cycles if self.cycles else None

    @property
    def drop(self) -> float | None:
        """How far the observed τ is below the reference, as a share (negative: above)."""
        tau = self.tau
        return None if tau is None or self.reference <= 0 else 1.0 - tau / self.reference

    def describe(self) -> str:
        if self.tau is None:
            return f"v{self.version}: no verify passes observed"
        where = f"{self.drop:.1%} below" if self.drop >= 0 else f"{-self.drop:.1%} above"
        return (f"v{self.version}: observed τ {self.tau:.3f} over RL steps "
                f"{list(self.steps)} ({self.cycles} verify passes), {where} its "
                f"{self.reference:.3f} at promotion")


def reading(series: list[StepAcceptance], version: str, reference: float, window: int,
            newest_step: int | None = None) -> Reading:
    """``version``'s counts summed over the last ``window`` steps of ``series`` in which it
    drafted, up to ``newest_step``."""
    drafted = [(o.step, o.of(version)) for o in series
               if o.of(version) is not None and (newest_step is None or o.step <= newest_step)]
    last = sorted(drafted)[-window:]
    return Reading(version, reference, tuple(s for s, _ in last),
                   sum(v.emitted for _, v in last), sum(v.verify_ct for _, v in last))


def healthy(r: Reading | None, policy: DriftPolicy) -> bool:
    """Whether the serving drafter is measurably fine: enough verify passes, and a drop of at
    most ``max_drop``. Not knowing is not healthy."""
    return (r is not None and r.cycles >= policy.min_cycles and r.drop is not None
            and r.drop <= policy.max_drop)


@dataclass(frozen=True)
class Verdict:
    trigger: bool
    armed: bool  # the state to keep for the next evaluation
    reason: str


def decide(r: Reading | None, policy: DriftPolicy, *, armed: bool, newest_step: int,
           last_refresh_step: int | None) -> Verdict:
    """Whether the drift trigger fires now (see the module doc)."""
    if r is None:
        return Verdict(False, True, "no drafter serves: nothing can drift")
    if r.cycles < policy.min_cycles or r.drop is None:
        return Verdict(False, armed, f"{r.describe()}: fewer than {policy.min_cycles} verify "
                                     f"passes, nothing to judge")
    if not armed:
        if r.drop <= policy.rearm_drop:
            return Verdict(False, True, f"{r.describe()}: recovered, re-armed")
        return Verdict(False, False, f"{r.describe()}: fired already for this drop; re-arms "
                                     f"at a drop of {policy.rearm_drop:.0%} or a new drafter")
    if r.drop <= policy.max_drop:
        return Verdict(False, True, f"{r.describe()}: within {policy.max_drop:.0%}")
    if last_refresh_step is not None and newest_step - last_refresh_step < policy.cooldown_steps:
        return Verdict(False, True, f"{r.describe()}: but a refresh ran at step "
                                    f"{last_refresh_step}, within the cooldown of "
                                    f"{policy.cooldown_steps} steps")
    return Verdict(True, False, f"{r.describe()}: more than {policy.max_drop:.0%}")


@dataclass(frozen=True)
class Watch:
    """The drafter serving now, its τ at promotion, and what the RL engine reported in the
    RL steps since its refresh (oldest first)."""

    version: str
    reference: float
    series: tuple[StepAcceptance, ...]

    def reading(self, window: int, newest_step: int | None = None) -> Reading:
        return reading(list(self.series), self.version, self.reference, window, newest_step)

    def recovered_after(self, step: int, policy: DriftPolicy) -> bool:
        """Whether a reading ending after RL step ``step`` was back within ``rearm_drop``
        (on enough verify passes): what re-arms the trigger after it fired at ``step``."""
        for o in self.series:
            if o.step <= step or o.of(self.version) is None:
                continue
            r = self.reading(policy.window, o.step)
            if r.cycles >= policy.min_cycles and r.drop is not None \
                    and r.drop <= policy.rearm_drop:
                return True
        return False


def watch(storage, name: str) -> Watch | None:
    """The :class:`Watch` of the drafter serving ``name``: None when no drafter serves or its
    τ at promotion is unknown (no report of its own refresh). Reads the observed steps from
    its refresh step on only."""
    from pipeline.checks import serving_state
    from pipeline.monitor.observed import observed_series

    state = serving_state(storage, name)
    if state is None or not state.version or state.tau_at_promotion is None:
        return None
    return Watch(state.version, state.tau_at_promotion,
                 tuple(observed_series(storage, since=state.window_end)))


def serving_reading(storage, name: str, window: int, newest_step: int | None = None
                    ) -> Reading | None:
    """The serving drafter's :class:`Reading` (None: see :func:`watch`)."""
    w = watch(storage, name)
    return None if w is None else w.reading(window, newest_step)
