"""Per micro-batch, the CP attention flavour: all-gather (the default) or Ulysses where it is faster.

When the run allows Ulysses (`CostModel.cp_attention`), the cost model charges every CP micro-batch
the communication of the faster flavour: the all-gather's (K/V gathered, overlapped with attention)
or Ulysses' (all-to-all of q, k, v and output, nothing overlapped; only where the heads split over the
group), so the policies size groups knowing both. This pass then labels each micro-batch of a CP
group with the flavour its estimate came from (Ulysses wherever it can run when the run asked for it
alone: `CostModel.prefer_ulysses`), and the runtime runs that flavour. Memory is the same (whole documents for
H/c heads hold as many activation bytes as the zig-zag share for all heads), so a plan that fit still
fits; estimates do not change here.
"""
from __future__ import annotations

import dataclasses

from dcp_megatron.planner.plan import Group


def choose_cp_attention(waves, cost) -> list:
    """`waves` with each CP micro-batch on its faster flavour (unchanged when Ulysses is not allowed)."""
    if "ulysses" not in cost.cp_attention:
        return waves
    chosen = []
    for wave in waves:
        groups = []
        for group in wave.groups:
            if group.size > 1:
                group = Group(group.first_rank, group.size, tuple(_faster(mb, group, cost) for mb in group.microbatches))
            groups.append(group)
        chosen.append(dataclasses.replace(wave, groups=tuple(groups)))
    return type(waves)(chosen) if isinstance(waves, (list, tuple)) else chosen


def _faster(microbatch, group, cost):
    if not microbatch.sequences:
        return microbatch
    seconds = cost.ulysses_time(microbatch.lengths, group.size, first_rank=group.first_rank,
                                recompute=microbatch.recompute)
    # The cost model already charged each CP micro-batch the faster flavour's communication: Ulysses won
    # where its own time is the estimate (or it is forced).
    if seconds is None or (seconds > microbatch.est_time_s * (1 + 1e-9) and not cost.prefer_ulysses):
        return microbatch
    return dataclasses.replace(microbatch, attention="ulysses")

