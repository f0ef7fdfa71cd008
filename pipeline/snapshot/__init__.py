"""Stage 1, ``rollout_snapshot``: the RL trainer's rollouts of one step, validated.

- :mod:`.schema`: the rollout record contract (Arrow schema, limits, per-record checks);
  :mod:`.counters`: what a record's speculative counters say the verify passes emitted.
- :mod:`.writer`: :class:`~.writer.SnapshotWriter`, what an RL trainer calls once per step.
- :mod:`.policy`: publishing and reading the step's policy checkpoint.
- :mod:`.stage`: ``run`` re-validates a written step and commits the accepted records and
  the quarantine (with reasons); ``completed_steps`` lists what trainers finished.
"""
