"""megatron-dynamic's scheduler as first written, a scan of every group per sequence (O(sequences x groups)): the
reference the blocked search (planner/baselines/dynamic_groups.py) must equal, schedule for schedule."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

WORKLOAD_SLACK = 0.05


def schedule_groups_by_scan(lengths: list[int], sizes: list[int], D: int, cap: int) -> list[list[tuple[int, list[int]]]]:
    """megatron_dynamic.schedule_groups as it was written first: every group scanned per sequence."""
    arr = np.asarray(lengths, dtype=np.int64)
    share = [(2 * -(-arr // (2 * s))).tolist() for s in sizes]     # padded tokens per rank, per size
    fits = np.stack([np.asarray(row) <= cap for row in share])
    if not fits[-1].all():
        j = int(np.flatnonzero(~fits[-1])[0])
        raise ValueError(f"megatron-dynamic: a sequence of {lengths[j]} tokens fits no CP size up to {sizes[-1]} "
                         f"at {cap} tokens per rank")
    table = _Tables(sizes=sizes, share=share, smallest=fits.argmax(axis=0).tolist(), square=(arr * arr).tolist(), length=lengths)
    remaining = sorted(range(len(lengths)), key=lambda i: -lengths[i])   # stable: ties keep batch order
    out = []
    while remaining:
        groups, remaining = _one_microbatch(remaining, table, D, cap)
        groups.sort(key=lambda g: -g[0])                                  # stable: creation order within a size
        out.append(groups)
    return out


class _Tables(NamedTuple):
    sizes: list[int]
    share: list[list[int]]      # [size index][sequence]
    smallest: list[int]         # index of each sequence's smallest size
    square: list[int]           # L² of each sequence
    length: list[int]


def _one_microbatch(order, t: _Tables, D: int, cap: int):
    sizes, share, square = t.sizes, t.share, t.square
    first = order[0]
    k0 = t.smallest[first]
    bound = t.length[first] * cap * (1 + WORKLOAD_SLACK)
    size, members, packed, work = [k0], [[first]], [share[k0][first]], [square[first] / sizes[k0]]
    of_size = [[] for _ in sizes]                     # group ids per size index, creation order
    of_size[k0].append(0)
    room = [0] * len(sizes)                           # upper bound of free tokens per rank, per size
    room[k0] = cap - packed[0]
    used, busiest = sizes[k0], work[0]
    leftovers = []

    def placeable(i: int) -> bool:
        """Whether any placement of sequence i fits; with the state fixed this only turns from
        False to True along `order` (shorter sequences fit wherever longer ones do)."""
        for k in range(t.smallest[i], len(sizes)):
            s, need = sizes[k], share[k][i]
            w = square[i] / s
            if (D - used >= s and w <= bound) or any(need <= cap - packed[g] and work[g] + w <= bound
                                                      for g in of_size[k]):
                return True
        return False

    p, n = 1, len(order)
    while p < n:
        i = order[p]
        p += 1
        best = None                                   # (busiest after, group or None, size index)
        for k in range(t.smallest[i], len(sizes)):
            s, need = sizes[k], share[k][i]
            w = square[i] / s
            if need <= room[k]:
                most = 0                              # tightens room[k] when the scan completes
                for g in of_size[k]:
                    free = cap - packed[g]
                    if need <= free:
                        after = work[g] + w
                        after = busiest if after < busiest else after
                        if after <= bound and (best is None or after < best[0]):
                            best = (after, g, k)
                            if after == busiest:      # nothing found later can be lower
                                break
                    most = free if free > most else most
                else:
                    room[k] = most
            if best is not None and best[0] == busiest:
                break
            if D - used >= s:
                after = busiest if w < busiest else w
                if after <= bound and (best is None or after < best[0]):
                    best = (after, None, k)
                    if after == busiest:
                        break
        if best is None:
            leftovers.append(i)
            # Skip the run of sequences that cannot be placed either (galloping search).
            step, lo, hi = 1, p, p
            while hi < n and not placeable(order[hi]):
                lo, hi, step = hi + 1, hi + step, 2 * step
            hi = min(hi, n)
            while lo < hi:
                mid = (lo + hi) // 2
                if placeable(order[mid]):
                    hi = mid
                else:
                    lo = mid + 1
            leftovers.extend(order[p:lo])
            p = lo
            continue
        busiest, g, k = best
        if g is None:
            size.append(k), members.append([]), packed.append(0), work.append(0.0)
            g, used = len(size) - 1, used + sizes[k]
            of_size[k].append(g)
        members[g].append(i)
        packed[g] += share[k][i]
        work[g] += square[i] / sizes[k]
        room[k] = max(room[k], cap - packed[g])
    size = [sizes[k] for k in size]
    while used < D:                                   # grow the first smallest group to the next size
        smallest = min(size)
        bigger = [s for s in sizes if s > smallest]
        if not bigger or used + bigger[0] - smallest > D:
            break
        g = size.index(smallest)
        size[g], used = bigger[0], used + bigger[0] - smallest
    if used < D and sizes[-1] == D:                   # rebuild as one full-domain group
        chosen, rest, left = [], [], cap
        for i in order:
            if share[-1][i] <= left:
                chosen.append(i)
                left -= share[-1][i]
            else:
                rest.append(i)
        return [(D, chosen)], rest
    return list(zip(size, members)), leftovers
