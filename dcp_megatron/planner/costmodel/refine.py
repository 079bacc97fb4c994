"""Online refinement of the cost model from measured micro-batch times.

Every step the runtime times each micro-batch it ran and adds, per bucket (CP size, relief), the
seconds the *uncorrected* cost model predicted and the seconds measured; one all-reduce of these
sums makes every rank hold the same numbers. A bucket's relief is the micro-batch's Recompute by
its own name (`str(recompute)`: `none`, `mlp`, `core_attn+mlp`, `full2`, `selective` for core
attention alone, ...), and a factor scales only that relief's times (`CostModel._scaled`): MLP
recompute measured slow makes MLP recompute dearer, not core attention's. The buckets of a step
are those its plan uses (`plan_buckets`): every rank holds the same plan, so the all-reduce's
layout agrees without a fixed list of every CP size and relief. `TimeCorrection.update` then
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

Bucket = tuple[int, str]   # (CP size, relief name)


@dataclass(frozen=True)
class MeasuredMicroBatch:
    cp_size: int
    relief: str          # str(the micro-batch's Recompute): the relief it ran
    predicted_s: float   # by the uncorrected cost model
    measured_s: float


def plan_buckets(plan) -> list[Bucket]:
    """The (CP size, relief name) pairs of a plan's non-empty micro-batches, sorted: the step's bucket layout."""
    return sorted({(group.size, str(mb.recompute)) for wave in plan.waves for group in wave.groups
                   for mb in group.microbatches if mb.sequences})


@dataclass
class TimeCorrection:
    """Factors per (cp size, relief name), smoothed over steps (see the module docstring)."""

    smoothing: float = 0.5          # weight of the newest step's ratio
    min_predicted_s: float = 1e-4   # buckets with less predicted time this step are left alone
    factors: dict[Bucket, float] = field(default_factory=dict)
    steps: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing}")

    @staticmethod
    def bucket_sums(measured: Iterable[MeasuredMicroBatch], buckets: Sequence[Bucket]) -> list[float]:
        """[predicted, measured] seconds per bucket of `buckets`, flattened: what the ranks all-reduce (sum)."""
        index = {bucket: i for i, bucket in enumerate(buckets)}
        sums = [0.0] * (2 * len(index))
        for mb in measured:
            i = index.get((mb.cp_size, mb.relief))
            if i is None:
                raise ValueError(f"no bucket for cp size {mb.cp_size}, relief {mb.relief!r}")
            sums[2 * i] += mb.predicted_s
            sums[2 * i + 1] += mb.measured_s
        return sums

    def update(self, summed: Sequence[float], buckets: Sequence[Bucket]) -> dict[Bucket, float]:
        """Fold one step's all-reduced sums over `buckets` into the factors; returns the new factors."""
        if len(summed) != 2 * len(buckets):
            raise ValueError(f"expected {2 * len(buckets)} sums, got {len(summed)}")
        factors = dict(self.factors)
        for i, bucket in enumerate(buckets):
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
