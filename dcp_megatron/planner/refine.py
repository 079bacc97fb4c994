"""Online refinement of the cost model from measured micro-batch times.

Every step the runtime times each micro-batch it ran and adds, per bucket (CP size, recompute
kind), the seconds the *uncorrected* cost model predicted and the seconds measured; one
all-reduce of these sums makes every rank hold the same numbers. `TimeCorrection.update` then
moves each bucket's factor towards measured / predicted (a geometric moving average, so one
noisy step moves it only part way), and the next plans are made with
`CostModel.with_time_scale(correction.factors)`. All ranks apply the same updates in the same
order, so their cost models, and their plans, stay identical.

Pure Python: the caller does the timing and the all-reduce (`bucket_sums` is its layout).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

RECOMPUTE_KINDS = ("none", "selective", "full")


@dataclass(frozen=True)
class MeasuredMicroBatch:
    cp_size: int
    recompute_kind: str
    predicted_s: float   # by the uncorrected cost model
    measured_s: float


@dataclass
class TimeCorrection:
    """Factors per (cp size, recompute kind), smoothed over steps (see the module docstring)."""

    cp_sizes: tuple[int, ...]
    smoothing: float = 0.5          # weight of the newest step's ratio
    min_predicted_s: float = 1e-4   # buckets with less predicted time this step are left alone
    factors: dict[tuple[int, str], float] = field(default_factory=dict)
    steps: int = 0

    def __post_init__(self) -> None:
        if not self.cp_sizes or any(c < 1 for c in self.cp_sizes) or len(set(self.cp_sizes)) != len(self.cp_sizes):
            raise ValueError(f"cp_sizes must be distinct positive sizes, got {self.cp_sizes}")
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing}")

    @property
    def buckets(self) -> list[tuple[int, str]]:
        return [(cp, kind) for cp in self.cp_sizes for kind in RECOMPUTE_KINDS]

    def bucket_sums(self, measured: Iterable[MeasuredMicroBatch]) -> list[float]:
        """[predicted, measured] seconds per bucket, flattened: what the ranks all-reduce (sum)."""
        index = {bucket: i for i, bucket in enumerate(self.buckets)}
        sums = [0.0] * (2 * len(index))
        for mb in measured:
            i = index.get((mb.cp_size, mb.recompute_kind))
            if i is None:
                raise ValueError(f"no bucket for cp size {mb.cp_size}, recompute {mb.recompute_kind!r}")
            sums[2 * i] += mb.predicted_s
            sums[2 * i + 1] += mb.measured_s
        return sums

    def update(self, summed: Sequence[float]) -> dict[tuple[int, str], float]:
        """Fold one step's all-reduced bucket sums into the factors; returns the new factors."""
        if len(summed) != 2 * len(self.buckets):
            raise ValueError(f"expected {2 * len(self.buckets)} sums, got {len(summed)}")
        factors = dict(self.factors)
        for i, bucket in enumerate(self.buckets):
            predicted, measured = float(summed[2 * i]), float(summed[2 * i + 1])
            if predicted < self.min_predicted_s or not (math.isfinite(measured) and measured > 0):
                continue
            old = factors.get(bucket)
            ratio = measured / predicted
            factors[bucket] = ratio if old is None else old ** (1 - self.smoothing) * ratio ** self.smoothing
        self.factors = factors
        self.steps += 1
        return factors


def relative_error(predicted_s: float, measured_s: float) -> float:
    """|predicted - measured| / measured (inf when nothing was measured)."""
    return abs(predicted_s - measured_s) / measured_s if measured_s > 0 else math.inf
