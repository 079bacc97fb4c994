"""A lower bound on any plan's step time for one batch (DESIGN.md §5).

max( total compute of the batch at CP size 1, unpadded, without communication, recompute or
     per-micro-batch overhead, divided by the D ranks  — perfect balance,
     the longest sequence alone in a micro-batch on its best allowed group size — it has to run
     somewhere, with the fastest recompute that fits there )
Per-rank compute at CP size c is never below the c=1 share (padding only adds tokens and the
attention rate grows with the chunk length), so the first term bounds every layout.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from dcp_megatron.planner.policies.common import candidate_sizes, check_batch, check_static_memory


def lower_bound(batch: Sequence[tuple[int, int]], cost) -> float:
    """Seconds no plan of this batch can beat (ValueError on a malformed batch)."""
    return lower_bound_of_lengths(check_batch(batch)[1], cost)


def lower_bound_of_lengths(lengths: np.ndarray, cost) -> float:
    check_static_memory(cost)
    balanced = cost.ideal_rank_seconds(lengths) / cost.cluster.domain_size
    longest = int(lengths.max())
    best = math.inf
    for size in candidate_sizes(cost.cluster):
        local, compute, attn = (float(x[0]) for x in cost.doc_terms(np.array([longest]), size))
        recompute = cost.best_recompute_from_sums(local, compute, attn, size)
        if recompute is not None:
            best = min(best, cost.time_from_sums(local, compute, attn, size, 0, recompute))
    if math.isinf(best):
        raise ValueError(f"a sequence of {longest} tokens fits no allowed CP group "
                         f"(cp_size_limit {cost.cluster.cp_size_limit}) even with the strongest allowed recompute")
    return max(balanced, best)
