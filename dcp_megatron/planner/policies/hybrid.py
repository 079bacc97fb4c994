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

import math

import numpy as np

from dcp_megatron.planner.plan import Group, MicroBatch, Wave
from dcp_megatron.planner.policies.common import lpt_bins, local_tokens, microbatch_from_sums, pow2_sizes
from dcp_megatron.planner.policies.static import static_layout


def plan_megatron_hybrid(ids, lengths, cost, *, max_seq_len: int, packing=None,
                         must_beat: float | None = None) -> tuple[Wave, ...] | None:
    """The plan's waves; None when `must_beat` is given and the plan would not be faster."""
    cluster = cost.cluster
    D = cluster.domain_size
    layout = packing[0] if packing else static_layout(cost, max_seq_len)
    cap = layout.capacity_local_tokens
    sizes = sorted(set(pow2_sizes(cluster.cp_size_limit)) | {layout.cp_size})
    cp = np.full(lengths.shape, layout.cp_size, dtype=np.int64)
    for s in reversed(sizes):
        cp[local_tokens(lengths, s) <= cap] = s
    seqs = list(zip(ids.tolist(), lengths.tolist()))
    total_rank_tokens = float((local_tokens(lengths, 1)).sum())
    waves_needed = max(1, math.ceil(total_rank_tokens / (D * cap)))
    buckets: list[tuple[int, list[int]]] = []
    for s in sorted(set(cp.tolist()), reverse=True):
        members = np.flatnonzero(cp == s)
        loc = local_tokens(lengths[members], s)
        work_arr = lengths[members].astype(np.float64) ** 2 / s
        order = np.lexsort((members, -work_arr)).tolist()
        work = work_arr.tolist()
        member_list = members.tolist()
        share = float(loc.sum()) * s / total_rank_tokens
        count = min(len(members), max(math.ceil(float(loc.sum()) / cap), int(waves_needed * D * share / s)))
        for b in lpt_bins(order, work, loc.tolist(), cap, max(count, 1)):
            buckets.append((s, [member_list[i] for i in b]))
    waves = _place(buckets, D, cluster.cp_size_limit)
    placed = [(first, size, b) for wave in waves for first, size, b in sorted(wave)]
    flat = np.fromiter((i for _, _, b in placed for i in b), dtype=np.int64, count=lengths.size)
    counts = [len(b) for _, _, b in placed]
    seq_group = np.empty(lengths.size, dtype=np.int64)
    seq_group[flat] = np.repeat(np.arange(len(placed)), counts)
    seq_size = np.empty(lengths.size, dtype=np.int64)
    seq_size[flat] = np.repeat([size for _, size, _ in placed], counts)
    sums = np.zeros((3, len(placed)))
    for size in np.unique(seq_size).tolist():
        sel = np.flatnonzero(seq_size == size)
        for row, part in zip(sums, cost.doc_terms(lengths[sel], size)):
            row += np.bincount(seq_group[sel], weights=part, minlength=len(placed))
    # One global setting: the least recompute with which the fullest bucket fits.
    recompute = next(r for r in cost.recompute_options() if cost.memory_from_tokens(float(sums[0].max()), r)
                     <= cluster.mem_budget_bytes)
    local_s, compute_s, attn_s = (row.tolist() for row in sums)
    if must_beat is not None:
        finish, g = [0.0] * D, 0
        for wave in waves:
            for first, size, _ in sorted(wave):
                end = max(finish[first:first + size]) + cost.time_from_sums(
                    local_s[g], compute_s[g], attn_s[g], size, first, recompute)
                finish[first:first + size] = [end] * size
                g += 1
        if max(finish) >= must_beat:
            return None
    out, g = [], 0
    for wave in waves:
        groups, r = [], 0
        for first, size, b in sorted(wave):
            groups.extend(_idle(rank, cost) for rank in range(r, first))
            mb = microbatch_from_sums(cost, tuple(map(seqs.__getitem__, b)), local_s[g], compute_s[g], attn_s[g],
                                      size, first, recompute)
            groups.append(Group(first, size, (mb,)))
            r, g = first + size, g + 1
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
        while grown:              # passes over the groups, smallest first, until none can grow
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
    return waves
