"""Longest-processing-time list scheduling (LPT) in numpy rounds, exactly as the heap does it.

Items come longest first; each goes to the bin with the least load (ties: lowest bin index),
which is what `common.lpt_assign` does with one heap operation per item. With many bins most
consecutive items land on distinct bins, so a whole round is decided at once: with the bins
sorted by (load, index), items j = 0, 1, ... go to bins j = 0, 1, ... for as long as bin j's
load is below every new load min_{k<j}(load_k + item_k) of the bins just filled (strictly: on
a tie the next round's sort settles it by index, as the heap would). A round that places few
items (few bins, or items far larger than the gaps between loads) hands the rest to the heap.
"""
from __future__ import annotations

import numpy as np

from dcp_megatron.planner.policies.common import lpt_assign

# Rounds cost a few numpy calls each (tens of µs), a heap step well under one µs: below this
# many items per round the heap is faster.
MIN_ITEMS_PER_ROUND = 64


def lpt_assign_rounds(times: np.ndarray, loads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(bin of each item, final loads); `times` longest first. Same result as `lpt_assign`."""
    times = np.asarray(times, dtype=np.float64)
    loads = np.array(loads, dtype=np.float64)
    n, num_bins = times.size, loads.size
    where = np.empty(n, dtype=np.int64)
    done = 0
    while done < n and num_bins >= MIN_ITEMS_PER_ROUND:
        order = np.argsort(loads, kind="stable")
        sorted_loads = loads[order]
        batch = times[done:done + num_bins]
        new_loads = sorted_loads[:batch.size] + batch
        # bin j (j >= 1) joins the round while its load is below all new loads of bins 0..j-1
        joins = np.minimum.accumulate(new_loads)[:-1] > sorted_loads[1:batch.size]
        count = batch.size if joins.all() else 1 + int(np.argmin(joins))
        where[done:done + count] = order[:count]
        loads[order[:count]] = new_loads[:count]
        done += count
        if count < MIN_ITEMS_PER_ROUND:
            break
    if done < n:
        rest, final = lpt_assign(times[done:].tolist(), loads.tolist())
        where[done:] = rest
        loads = np.asarray(final)
    return where, loads
