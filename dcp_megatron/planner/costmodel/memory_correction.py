"""A conservative correction of the memory count from measured bytes (docs/cost_model.md, "Measured memory").

The planner packs every micro-batch up to its memory budget by construction, so a count that is low runs out of
memory and one that is high pays relief nobody needed. Measured bytes correct it per relief (the micro-batch's
Recompute by its own name, `str(recompute)`): a factor scales the activation bytes per local token the cost model
counts for that relief (`CostModel.with_memory_scale`), never the static state.

A reading is one micro-batch's measured bytes against the uncorrected count of the same quantity (on GPU its peak
above the static state, on CPU the bytes its forward saved for backward). Per step, each relief's ratio is the
largest measured / counted over the step's micro-batches and over all ranks (memory is about the worst rank: the
caller all-reduces with MAX), and `MemoryCorrection.update` turns it into the factor plans use:

- the target is the ratio times (1 + `margin`): the headroom kept above what was measured, stated in the log;
- a target above the factor in use takes effect at once (more bytes counted is always safe);
- a lower one takes effect only once `lower_after` updates in a row have all been below the factor, and then
  as the highest of them, never below `floor`: one small reading never loosens the count.

A reading whose micro-batch was packed to less than `min_counted_bytes` (its count against the budget,
`packed_bytes`) is left out (the noise guard): a short micro-batch's reading is
dominated by fixed allocations (gradient reduction buffers, ZeRO-3 gathers, first-use workspaces) that do not grow
with its tokens, so its measured / counted says little of the count's per-token error and, raised at once, would
shrink every later micro-batch (and could refuse the run's --seq-length). The step loop sets the floor to
`NOISE_SHARE` of the activation room (`noise_floor_bytes`): a fixed cost F then inflates a factor by at most
F / floor, while the largest micro-batches, the ones a low count would put over the device, are all read.

A relief that has no reading yet is scaled by the largest factor measured, when that is above 1 (reliefs share
most of their tensors, so a count found low for one is likely low for the others), else left as counted.
All ranks fold the same all-reduced ratios in the same order, so their factors, and their plans, are identical.
Pure Python: the caller measures and all-reduces (`bucket_ratios` is its layout).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

MEMORY_MARGIN = 0.05      # headroom kept above the measured bytes (5%)
MEMORY_FLOOR = 0.8        # no factor goes below: a count is never trusted to be more than 20% high
LOWER_AFTER = 3           # updates in a row below the factor in use before it is lowered
NOISE_SHARE = 0.25        # readings counted below this share of the activation room are noise (fixed costs)


def noise_floor_bytes(cost, share: float = NOISE_SHARE) -> float:
    """The count below which a reading is left out: `share` of what the plans may fill above the static bytes."""
    return max(0.0, share * (cost.cluster.mem_budget_bytes - cost.static_bytes))


@dataclass(frozen=True)
class MemoryScale:
    """What the cost model applies: a factor per relief name, and the one for reliefs not measured."""

    factors: Mapping[str, float] = field(default_factory=dict)
    default: float = 1.0

    def __post_init__(self) -> None:
        bad = {k: v for k, v in {**self.factors, "(default)": self.default}.items()
               if not (math.isfinite(v) and v > 0)}
        if bad:
            raise ValueError(f"memory scale factors must be positive and finite, got {bad}")

    def of(self, relief: str) -> float:
        return self.factors.get(relief, self.default)

    @property
    def is_identity(self) -> bool:
        return self.default == 1.0 and all(v == 1.0 for v in self.factors.values())


NO_MEMORY_SCALE = MemoryScale()


@dataclass(frozen=True)
class MemoryReading:
    """One micro-batch's measured bytes against the uncorrected count of the same quantity."""

    relief: str            # str(the micro-batch's Recompute)
    counted_bytes: float
    measured_bytes: float
    # the micro-batch's count as it was packed against the budget (its peak above the static bytes), what the noise
    # floor is compared with; None: `counted_bytes` (a reading of that same quantity, the GPU's peak)
    packed_bytes: float | None = None


def relief_buckets(plan) -> list[str]:
    """The relief names of a plan's non-empty micro-batches, sorted: the step's layout (the same on every rank)."""
    return sorted({str(mb.recompute) for wave in plan.waves for group in wave.groups for mb in group.microbatches
                   if mb.sequences})


@dataclass
class MemoryCorrection:
    """Factors per relief name from measured bytes (see the module docstring)."""

    margin: float = MEMORY_MARGIN
    floor: float = MEMORY_FLOOR
    lower_after: int = LOWER_AFTER
    min_counted_bytes: float = 0.0    # readings packed smaller than this are noise (fixed costs dominate)
    factors: dict[str, float] = field(default_factory=dict)
    lower_targets: dict[str, list[float]] = field(default_factory=dict)   # targets below the factor, in a row
    ratios: dict[str, float] = field(default_factory=dict)                 # the last measured / counted per relief
    updates: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.margin) and self.margin >= 0):
            raise ValueError(f"the memory margin must be >= 0, got {self.margin}")
        if not 0 < self.floor <= 1:
            raise ValueError(f"the memory floor must be in (0, 1], got {self.floor}")
        if self.lower_after < 1:
            raise ValueError(f"lower_after must be >= 1, got {self.lower_after}")

    def bucket_ratios(self, readings: Iterable[MemoryReading], buckets: Sequence[str]) -> list[float]:
        """The largest measured / counted per bucket of `buckets` (0: no reading): what the ranks all-reduce (MAX)."""
        index = {bucket: i for i, bucket in enumerate(buckets)}
        out = [0.0] * len(index)
        for reading in readings:
            i = index.get(reading.relief)
            if i is None:
                raise ValueError(f"no bucket for relief {reading.relief!r}")
            packed = reading.counted_bytes if reading.packed_bytes is None else reading.packed_bytes
            if (reading.counted_bytes > 0 and packed >= self.min_counted_bytes
                    and math.isfinite(reading.measured_bytes)):
                out[i] = max(out[i], reading.measured_bytes / reading.counted_bytes)
        return out

    def update(self, ratios: Sequence[float], buckets: Sequence[str]) -> MemoryScale:
        """Fold one step's all-reduced ratios over `buckets` into the factors; returns the scale to plan with."""
        if len(ratios) != len(buckets):
            raise ValueError(f"expected {len(buckets)} ratios, got {len(ratios)}")
        for bucket, ratio in zip(buckets, ratios):
            ratio = float(ratio)
            if not (math.isfinite(ratio) and ratio > 0):
                continue
            self.ratios[bucket] = ratio
            target = max(ratio * (1 + self.margin), self.floor)
            current = self.factors.get(bucket, 1.0)
            if target >= current:
                self.factors[bucket] = target
                self.lower_targets.pop(bucket, None)
                continue
            below = self.lower_targets.setdefault(bucket, [])
            below.append(target)
            if len(below) >= self.lower_after:
                self.factors[bucket] = max(below[-self.lower_after:])
                del self.lower_targets[bucket]
        self.updates += 1
        return self.scale()

    def scale(self) -> MemoryScale:
        """The factors in use, and for unmeasured reliefs the largest of them when above 1 (module docstring)."""
        return MemoryScale(factors=dict(self.factors), default=max([1.0, *self.factors.values()]))


def describe_scale(scale: MemoryScale, margin: float, updates: int) -> str:
    """`memory x1.05 (none), x1.30 (mlp), others x1.30, margin 5%, 2 updates`: the factors in use and how many
    measured steps (a probe counts one) made them, for the log line."""
    shown = ", ".join(f"x{factor:.2f} ({relief})" for relief, factor in sorted(scale.factors.items()))
    return f"memory {shown or 'as counted'}, others x{scale.default:.2f}, margin {margin:.0%}, {updates} updates"
