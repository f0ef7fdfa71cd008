"""Per-TTT-depth training metrics, summed over micro batches and ranks.

For each depth i the sums are ``Σ loss_i · count_i``, ``Σ correct_i`` and ``Σ count_i`` (a
micro batch's ``loss_i`` is a mean over its ``count_i`` counted positions), so any grouping of
micro batches — across accumulation steps, ranks or optimizer steps — aggregates to the same
count-weighted means. Simulated acceptance length is computed from the aggregated accuracies
(``Σ_k Π_{j≤k} acc_j``), never averaged per batch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.eagle3.ttt import TTTMetrics, simulated_accept_length


@dataclass
class MetricSums:
    """Additive sums of one or more micro batches (depth = TTT depth)."""

    depth: int
    values: torch.Tensor  # (3·depth + 3,) float64: loss·count, correct, count per depth;
    #                        then total loss, micro batches, real tokens

    @classmethod
    def zeros(cls, depth: int) -> MetricSums:
        return cls(depth, torch.zeros(3 * depth + 3, dtype=torch.float64))

    def add(self, m: TTTMetrics, tokens: int) -> None:
        d = self.depth
        for i, (loss, acc, n) in enumerate(zip(m.step_loss, m.accuracy, m.count, strict=True)):
            self.values[i] += loss * n
            self.values[d + i] += round(acc * n)
            self.values[2 * d + i] += n
        self.values[3 * d] += m.loss
        self.values[3 * d + 1] += 1
        self.values[3 * d + 2] += tokens

    def __iadd__(self, other: MetricSums) -> MetricSums:
        self.values += other.values
        return self

    @property
    def tokens(self) -> int:
        return int(self.values[3 * self.depth + 2])

    def summary(self) -> dict[str, Any]:
        """Count-weighted loss and accuracy per depth, mean total loss, acceptance length."""
        d, v = self.depth, self.values.tolist()
        counts = v[2 * d:3 * d]
        loss = [v[i] / counts[i] if counts[i] else 0.0 for i in range(d)]
        acc = [v[d + i] / counts[i] if counts[i] else 0.0 for i in range(d)]
        batches = v[3 * d + 1]
        return {"loss": v[3 * d] / batches if batches else 0.0,
                "sim_accept_length": simulated_accept_length(acc),
                "depth_loss": loss, "depth_accuracy": acc,
                "depth_count": [int(c) for c in counts], "tokens": int(v[3 * d + 2])}

    def to_list(self) -> list[float]:
        return self.values.tolist()

    @classmethod
    def from_list(cls, depth: int, values: list[float]) -> MetricSums:
        return cls(depth, torch.tensor(values, dtype=torch.float64))


def all_reduce(sums: MetricSums, device: torch.device | str = "cpu") -> MetricSums:
    """The sums over every rank (a copy without a process group); ``device`` is where the
    backend reduces (CPU for gloo, the rank's GPU for NCCL)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return MetricSums(sums.depth, sums.values.clone())
    buf = sums.values.to(device, copy=True)
    dist.all_reduce(buf)
    return MetricSums(sums.depth, buf.cpu())


def aggregate(depth: int, rows: Iterable[list[float]]) -> MetricSums:
    total = MetricSums.zeros(depth)
    for row in rows:
        total += MetricSums.from_list(depth, row)
    return total


def depth_table(summary: dict[str, Any]) -> list[dict[str, float]]:
    """One row per TTT depth: loss, accuracy, cumulative acceptance length, count."""
    rows, run, cumulative = [], 1.0, 0.0
    for i, (loss, acc, n) in enumerate(zip(summary["depth_loss"], summary["depth_accuracy"],
                                           summary["depth_count"], strict=True)):
        run *= acc
        cumulative += run
        rows.append({"depth": i, "loss": loss, "accuracy": acc, "accept_length": cumulative,
                     "count": n})
    return rows
