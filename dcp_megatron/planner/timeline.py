"""When each rank runs what: the per-rank timeline a plan implies, and its makespan.

Semantics (the runtime's): every rank walks the waves in order. A group with micro-batches
starts when all its members have finished their previous waves, then runs its micro-batches
back to back (est_time_s each). A group without micro-batches does nothing and waits for
nobody. The makespan is when the last rank finishes. The pipeline-parallel bubble is not
modelled here (it is the same (pp-1)-stage fill for every plan with equal micro-batch counts).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from dcp_megatron.planner.plan import StepPlan


class Slot(NamedTuple):
    start_s: float
    end_s: float
    wave_index: int
    group_first_rank: int
    group_size: int
    microbatch_index: int


def rank_timeline(plan: StepPlan) -> list[list[Slot]]:
    """Slots of every rank of the domain, in time order."""
    finish = [0.0] * plan.domain_size
    slots: list[list[Slot]] = [[] for _ in range(plan.domain_size)]
    for w, wave in enumerate(plan.waves):
        for g in wave.groups:
            if not g.microbatches:
                continue
            ranks = range(g.first_rank, g.first_rank + g.size)
            t = max(finish[r] for r in ranks)
            for i, mb in enumerate(g.microbatches):
                slot = Slot(t, t + mb.est_time_s, w, g.first_rank, g.size, i)
                for r in ranks:
                    slots[r].append(slot)
                t = slot.end_s
            for r in ranks:
                finish[r] = t
    return slots


def rank_finish_times(plan: StepPlan) -> list[float]:
    """When each rank finishes the step (same semantics as rank_timeline, without the slots)."""
    finish = [0.0] * plan.domain_size
    for wave in plan.waves:
        for g in wave.groups:
            if not g.microbatches:
                continue
            busy = sum(mb.est_time_s for mb in g.microbatches)
            if g.size == 1:
                finish[g.first_rank] += busy
                continue
            lo, hi = g.first_rank, g.first_rank + g.size
            end = max(finish[lo:hi]) + busy
            finish[lo:hi] = [end] * g.size
    return finish


def plan_makespan(plan: StepPlan) -> float:
    return float(max(rank_finish_times(plan), default=0.0))


def one_microbatch_makespan(wave_of: np.ndarray, first_of: np.ndarray, size_of: np.ndarray, times: np.ndarray,
                            domain_size: int) -> float:
    """`plan_makespan` of groups that each run one micro-batch of `times` seconds, given as arrays
    (no plan objects): per wave, a group starts when its slowest member is free."""
    finish = np.zeros(domain_size + 1)               # + a sentinel so a block may end at D
    for w in range(int(wave_of.max()) + 1 if wave_of.size else 0):
        sel = np.flatnonzero(wave_of == w)
        order = sel[np.argsort(first_of[sel], kind="stable")]
        firsts, sizes = first_of[order], size_of[order]
        edges = np.empty(2 * order.size, dtype=np.int64)
        edges[0::2], edges[1::2] = firsts, firsts + sizes
        start = np.maximum.reduceat(finish, edges)[0::2]
        ends = np.cumsum(sizes)
        ranks = np.repeat(firsts - (ends - sizes), sizes) + np.arange(int(ends[-1]))
        finish[ranks] = np.repeat(start + times[order], sizes)
    return float(finish[:domain_size].max())
