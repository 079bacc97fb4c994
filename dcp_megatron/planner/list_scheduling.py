"""Longest-processing-time list scheduling (LPT), the one place both families schedule items onto bins.

`lpt_assign`: items longest first, each to the bin with the least load (ties: lowest bin index), one heap
operation per item. `lpt_assign_rounds`: the same result in numpy rounds: with many bins most consecutive items
land on distinct bins, so a whole round is decided at once: with the bins sorted by (load, index), items
j = 0, 1, ... go to bins j = 0, 1, ... for as long as bin j's load is below every new load
min_{k<j}(load_k + item_k) of the bins just filled (strictly: on a tie the next round's sort settles it by
index, as the heap would). A round that places few items (few bins, or items far larger than the gaps between
loads) hands the rest to the heap. `lpt_bins`: equal-work bins that also have a token room.
"""
from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np


def lpt_assign(item_times: Sequence[float], loads: Sequence[float]) -> tuple[list[int], list[float]]:
    """Longest-processing-time list scheduling: items in the given order (longest first) each
    go to the bin with the least load (ties: lowest index). Returns bin per item, final loads."""
    heap = [(float(load), b) for b, load in enumerate(loads)]
    heapq.heapify(heap)
    where: list[int] = []
    add, replace = where.append, heapq.heapreplace       # local names: this loop is the hot path
    for t in item_times:
        load, b = heap[0]
        replace(heap, (load + t, b))
        add(b)
    final = [0.0] * len(loads)
    for load, b in heap:
        final[b] = load
    return where, final


def lpt_bins(order: Sequence[int], work: Sequence[float], tokens: Sequence[int], room: int,
             count: int) -> list[list[int]]:
    """Equal-work bins with a token room: each item (in the given order, largest first) to
    the least-worked open bin (ties: lowest bin); a bin without room for the item is closed
    (later items are no larger, so little is lost) and a new bin opens when none is left.
    Returns the non-empty bins (item indices in assignment order)."""
    heap = [(0.0, b) for b in range(count)]
    used = [0] * count
    bins: list[list[int]] = [[] for _ in range(count)]
    for i in order:
        need = tokens[i]
        while heap and used[heap[0][1]] + need > room:
            heapq.heappop(heap)
        if heap:
            w, b = heap[0]
            heapq.heapreplace(heap, (w + work[i], b))
        else:
            b = len(bins)
            bins.append([])
            used.append(0)
            heap.append((work[i], b))
        bins[b].append(i)
        used[b] += need
    return [b for b in bins if b]


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
