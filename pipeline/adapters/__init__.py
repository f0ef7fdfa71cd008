"""Adapters from RL trainers to Aerie's rollout snapshots (and back, for the drafter).

In order of fidelity: in-process recorders that see the ids the engine sampled
(:mod:`.trl`), readers of the dumps that keep exact ids, and readers of text dumps that must
be re-tokenized. Every adapter writes through :class:`~pipeline.snapshot.writer.SnapshotWriter`
and records the policy version that really generated the rollouts beside the trainer's step.
"""
