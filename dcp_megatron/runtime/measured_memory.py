"""Each micro-batch's measured memory, and the one collective that turns a step's readings into the memory scale.

Two readings, one per device (both cheap: no synchronisation, no copy):

- `PeakReadings` (GPU): before each micro-batch's forward the caching allocator's peak is reset and the bytes
  allocated then (the static state, and nothing of this micro-batch) noted; at the next forward (the schedule runs
  F0 B0 F1 B1 ... without pipelining) or at the end of the step, its forward and backward's peak above them is read:
  what the planner counts as the micro-batch's bytes above the static state (`bytes_per_local_token`).
- `SavedReadings` (CPU, which has no allocator statistics): the bytes its forward saved for backward, per storage
  (`memory_probe.SavedBytes`, the parameters excluded): what the planner counts as held
  (`held_bytes_per_local_token`).

`refined_memory_scale` compares a step's readings with the uncorrected count of the same quantity
(`counted_bytes`), takes the largest ratio per relief over the world (one MAX all-reduce: memory is about the worst
rank) and folds it into the correction (planner/costmodel/memory_correction.py); every rank gets the same scale.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from dcp_megatron.planner.costmodel.memory_correction import (MemoryCorrection, MemoryReading, MemoryScale,
                                                              relief_buckets)
from dcp_megatron.planner.padding import local_tokens
from dcp_megatron.runtime.memory_probe import SavedBytes

PEAK, SAVED = "peak", "saved"


class PeakReadings:
    """GPU: each micro-batch's allocator peak above what was allocated before its forward (module docstring)."""

    kind = PEAK

    def __init__(self) -> None:
        self.readings: list[float] = []
        self._before: int | None = None

    def run_forward(self, forward):
        self._close()
        self._before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        return forward(None)

    def finish(self) -> list[float]:
        self._close()
        return self.readings

    def _close(self) -> None:
        if self._before is not None:
            self.readings.append(float(torch.cuda.max_memory_allocated() - self._before))
            self._before = None


class SavedReadings:
    """CPU: the bytes each micro-batch's forward saved for backward (module docstring); `parameters` are excluded."""

    kind = SAVED

    def __init__(self, parameters) -> None:
        self.readings: list[float] = []
        self._parameters = list(parameters)

    def run_forward(self, forward):
        saved = SavedBytes(exclude=self._parameters)
        with saved:
            out = forward(saved)
        self.readings.append(float(sum(saved.bytes_by_bucket().values())))
        saved.release()
        return out

    def finish(self) -> list[float]:
        return self.readings


def memory_readings(*, cuda: bool, parameters):
    """The reading of this device: GPU peaks, CPU saved bytes."""
    return PeakReadings() if cuda else SavedReadings(parameters)


def counted_bytes(cost, lengths, cp_size: int, recompute, kind: str) -> float:
    """What `cost` counts of the quantity a reading of `kind` measures, for one micro-batch on this rank."""
    local = float(int(local_tokens(np.asarray(lengths, dtype=np.int64), cp_size).sum()))
    # at the micro-batch's own CP size: our CPU attention keeps per-group tensors (memory_spec.py, cp_size)
    per_token = (cost.bytes_per_local_token(recompute, cp_size) if kind == PEAK
                 else cost.held_bytes_per_local_token(recompute, cp_size))
    return local * per_token


def fold_readings(correction: MemoryCorrection, readings: list[MemoryReading], buckets: list[str], *, device,
                  group=None) -> MemoryScale:
    """The MAX all-reduce of the readings' ratios per bucket (a collective over `group`), folded into `correction`."""
    ratios = torch.tensor(correction.bucket_ratios(readings, buckets), dtype=torch.float64, device=device)
    if buckets:
        dist.all_reduce(ratios, op=dist.ReduceOp.MAX, group=group)
    return correction.update(ratios.tolist(), buckets)


def refined_memory_scale(correction: MemoryCorrection, base_cost, plan, *, domain_rank: int, measured: list[float],
                         kind: str, device, group=None) -> MemoryScale:
    """The scale after one step: `measured[i]` is the i-th micro-batch this rank ran, in plan order."""
    ran = [(group_, mb) for _, group_ in plan.rank_schedule(domain_rank) for mb in group_.microbatches]
    readings = [MemoryReading(relief=str(mb.recompute), measured_bytes=value,
                              counted_bytes=counted_bytes(base_cost, mb.lengths, group_.size, mb.recompute, kind),
                              packed_bytes=counted_bytes(base_cost, mb.lengths, group_.size, mb.recompute, PEAK))
                for (group_, mb), value in zip(ran, measured) if mb.sequences]
    return fold_readings(correction, readings, relief_buckets(plan), device=device, group=group)
