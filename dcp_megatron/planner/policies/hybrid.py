"""`megatron-hybrid`: Megatron-core's hybrid (dynamic) CP scheduler as published (DESIGN.md §5).

- max tokens per rank: the static layout's (the user's `max_seqlen_per_dp_cp_rank`);
- CP size of a sequence: the smallest power of two (or the static CP size) whose per-rank
  share of the sequence fits that;
- workload L²/c; per CP size, sequences longest-workload first into equal-work buckets of at
  most the per-rank token cap (as many buckets as tokens and the class's share of the
  domain need);
- buckets fill waves (each wave = one Megatron micro-batch step over the whole domain) at the
  first free aligned block; idle ranks are then filled by doubling the smallest groups whose
  buddy block is free;
- no recompute choice: one global setting, the fastest with which every bucket fits.
Each group runs its bucket as one micro-batch (so PP > 1 holds naturally); ranks left idle in
a wave run an empty micro-batch with PP > 1 and nothing with PP = 1.
"""
from __future__ import annotations

import heapq
import math

import numpy as np

from dcp_megatron.planner.plan import Group, MicroBatch, Wave
from dcp_megatron.planner.policies.common import local_tokens, microbatch_from_sums, pow2_sizes
from dcp_megatron.planner.policies.static import static_layout


def _buckets(order: list[int], work: list[float], local: list[int], cap: int, count: int) -> list[list[int]]:
    """Equal-work buckets: each item (in order) to the least-worked bucket with token room."""
    heap = [(0.0, b) for b in range(count)]
    used = [0] * count
    buckets: list[list[int]] = [[] for _ in range(count)]
    for i in order:
        skipped = []
        while heap and used[heap[0][1]] + local[i] > cap:
            skipped.append(heapq.heappop(heap))
        if heap:
            w, b = heapq.heappop(heap)
        else:
            b, w = len(buckets), 0.0
            buckets.append([])
            used.append(0)
        buckets[b].append(i)
        used[b] += local[i]
        heapq.heappush(heap, (w + work[i], b))
        for item in skipped:
            heapq.heappush(heap, item)
    return [b for b in buckets if b]


def plan_megatron_hybrid(ids, lengths, cost, *, max_seq_len: int) -> tuple[Wave, ...]:
    cluster = cost.cluster
    D = cluster.domain_size
    layout = static_layout(cost, max_seq_len)
    cap = layout.capacity_local_tokens
    sizes = sorted(set(pow2_sizes(cluster.cp_size_limit)) | {layout.cp_size})
    cp = np.full(lengths.shape, layout.cp_size, dtype=np.int64)
    for s in reversed(sizes):
        cp[local_tokens(lengths, s) <= cap] = s
    seqs = list(zip(ids.tolist(), lengths.tolist()))
    length_list = lengths.tolist()
    total_rank_tokens = float((local_tokens(lengths, 1)).sum())
    waves_needed = max(1, math.ceil(total_rank_tokens / (D * cap)))
    buckets: list[tuple[int, list[int]]] = []
    for s in sorted(set(cp.tolist()), reverse=True):
        members = np.flatnonzero(cp == s)
        loc = local_tokens(lengths[members], s)
        work = (lengths[members].astype(np.float64) ** 2 / s).tolist()
        order = sorted(range(len(members)), key=lambda i: (-work[i], int(members[i])))
        share = float(loc.sum()) * s / total_rank_tokens
        count = min(len(members), max(math.ceil(float(loc.sum()) / cap), int(waves_needed * D * share / s)))
        for b in _buckets(order, work, loc.tolist(), cap, max(count, 1)):
            buckets.append((s, [int(members[i]) for i in b]))
    waves = _place(buckets, D, cluster.cp_size_limit)
    sums = [[cost._sums([length_list[i] for i in b], size) for _, size, b in sorted(wave)] for wave in waves]
    max_local = max(loc for wave in sums for loc, _, _ in wave)
    # One global setting: the least recompute with which the fullest bucket fits.
    recompute = next(r for r in cost.recompute_options() if cost.memory_from_tokens(max_local, r)
                     <= cluster.mem_budget_bytes)
    out = []
    for wave, wave_sums in zip(waves, sums):
        groups, r = [], 0
        for (first, size, b), (loc, comp, att) in zip(sorted(wave), wave_sums):
            groups.extend(_idle(rank, cost) for rank in range(r, first))
            mb = microbatch_from_sums(cost, tuple(seqs[i] for i in b), loc, comp, att, size, first, recompute)
            groups.append(Group(first, size, (mb,)))
            r = first + size
        groups.extend(_idle(rank, cost) for rank in range(r, D))
        out.append(Wave(tuple(groups)))
    return tuple(out)


def _idle(rank: int, cost) -> Group:
    if cost.model.pp == 1:
        return Group(rank, 1, ())
    return Group(rank, 1, (MicroBatch((), est_time_s=cost.cluster.microbatch_overhead_s,
                                      est_mem_bytes=cost.static_bytes),))


def _place(buckets: list[tuple[int, list[int]]], D: int, limit: int) -> list[list[tuple[int, int, list[int]]]]:
    """Buckets (largest CP size first) to the first wave with a free aligned block; then grow."""
    waves: list[list[tuple[int, int, list[int]]]] = []
    free: list[list[bool]] = []
    cursor: dict[tuple[int, int], int] = {}   # (wave, size) -> first offset not yet known busy
    for size, b in buckets:
        for w, occ in enumerate(free):
            first = cursor.get((w, size), 0)
            while first + size <= D and any(occ[first:first + size]):
                first += size
            cursor[(w, size)] = first
            if first + size <= D:
                break
        else:
            waves.append([])
            free.append([False] * D)
            w, first = len(waves) - 1, 0
        free[w][first:first + size] = [True] * size
        waves[w].append((first, size, b))
    for w, wave in enumerate(waves):
        grown = True
        while grown:
            grown = False
            for j in sorted(range(len(wave)), key=lambda j: (wave[j][1], wave[j][0])):
                first, size, b = wave[j]
                if size & (size - 1) or 2 * size > limit:
                    continue
                base = first - first % (2 * size)
                buddy = base + size if base == first else base
                if base + 2 * size <= D and not any(free[w][buddy:buddy + size]):
                    free[w][buddy:buddy + size] = [True] * size
                    wave[j] = (base, 2 * size, b)
                    grown = True
                    break
    return waves
