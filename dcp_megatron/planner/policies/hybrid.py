"""`megatron-hybrid`: Megatron-core's hybrid (dynamic) CP scheduler as published (DESIGN.md §5).

- max tokens per rank: the static layout's (the user's `max_seqlen_per_dp_cp_rank`);
- CP size of a sequence: the smallest power of two (or the static CP size) whose per-rank
  share of the sequence fits that;
- workload L²/c; per CP size, sequences longest-workload first into equal-work buckets of at
  most the per-rank token cap (as many buckets as tokens and the class's share of the
  domain need), dealt in serpentine order (least-worked-first when that would overflow);
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
    total_rank_tokens = float((local_tokens(lengths, 1)).sum())
    waves_needed = max(1, math.ceil(total_rank_tokens / (D * cap)))
    bucket_of = np.empty(lengths.size, dtype=np.int64)
    bucket_sizes: list[int] = []                 # CP size of each bucket, largest first
    for s in sorted(set(cp.tolist()), reverse=True):
        members = np.flatnonzero(cp == s)
        loc = local_tokens(lengths[members], s)
        work = lengths[members].astype(np.float64) ** 2 / s
        order = np.lexsort((members, -work))
        share = float(loc.sum()) * s / total_rank_tokens
        count = max(1, min(len(members), max(math.ceil(float(loc.sum()) / cap), int(waves_needed * D * share / s))))
        local_bucket, used = _equal_work_buckets(order, work, loc, cap, count)
        bucket_of[members] = len(bucket_sizes) + local_bucket
        bucket_sizes += [s] * used
    wave_of, first_of, size_of = _place(bucket_sizes, D, cluster.cp_size_limit)
    num = len(bucket_sizes)
    final_size = np.asarray(size_of)[bucket_of]
    sums = np.zeros((3, num))
    for size in np.unique(final_size).tolist():
        sel = np.flatnonzero(final_size == size)
        for row, part in zip(sums, cost.doc_terms(lengths[sel], size)):
            row += np.bincount(bucket_of[sel], weights=part, minlength=num)
    # One global setting: the least recompute with which the fullest bucket fits.
    recompute = next(r for r in cost.recompute_options() if cost.memory_from_tokens(float(sums[0].max()), r)
                     <= cluster.mem_budget_bytes)
    local_s, compute_s, attn_s = (row.tolist() for row in sums)
    run_order = sorted(range(num), key=lambda b: (wave_of[b], first_of[b]))
    if must_beat is not None:
        finish = [0.0] * D
        for b in run_order:
            lo, hi = first_of[b], first_of[b] + size_of[b]
            end = max(finish[lo:hi]) + cost.time_from_sums(local_s[b], compute_s[b], attn_s[b], hi - lo, lo,
                                                            recompute)
            finish[lo:hi] = [end] * (hi - lo)
        if max(finish) >= must_beat * (1 + 1e-9):     # margin: the plan's own sums may round lower
            return None
    by_bucket = np.argsort(bucket_of, kind="stable")
    cuts = np.flatnonzero(np.diff(bucket_of[by_bucket])) + 1
    seqs = list(zip(ids.tolist(), lengths.tolist()))
    contents = [part.tolist() for part in np.split(by_bucket, cuts)]
    out: list[list[Group]] = [[] for _ in range(max(wave_of, default=0) + 1)]
    next_rank = [0] * len(out)
    for b in run_order:
        w, first, size = wave_of[b], first_of[b], size_of[b]
        out[w].extend(_idle(rank, cost) for rank in range(next_rank[w], first))
        mb = microbatch_from_sums(cost, tuple(map(seqs.__getitem__, contents[b])), local_s[b], compute_s[b],
                                  attn_s[b], size, first, recompute)
        out[w].append(Group(first, size, (mb,)))
        next_rank[w] = first + size
    for w, groups in enumerate(out):
        groups.extend(_idle(rank, cost) for rank in range(next_rank[w], D))
    return tuple(Wave(tuple(groups)) for groups in out)


def _equal_work_buckets(order: np.ndarray, work: np.ndarray, tokens: np.ndarray, cap: int,
                        count: int) -> tuple[np.ndarray, int]:
    """Bucket of each item, and the number of buckets. Items longest-work first are dealt to
    `count` buckets in serpentine order (0..n-1, n-1..0, ...), which evens out work; if a
    bucket would pass the token cap, least-worked-first with a token room (`lpt_bins`)."""
    position = np.arange(order.size)
    lap, seat = position // count, position % count
    bucket = np.empty(order.size, dtype=np.int64)
    bucket[order] = np.where(lap % 2 == 0, seat, count - 1 - seat)
    if np.bincount(bucket, weights=tokens, minlength=count).max() <= cap:
        return bucket, min(count, order.size)
    bins = lpt_bins(order.tolist(), work.tolist(), tokens.tolist(), cap, count)
    for b, items in enumerate(bins):
        bucket[items] = b
    return bucket, len(bins)


def _idle(rank: int, cost) -> Group:
    if cost.model.pp == 1:
        return Group(rank, 1, ())
    return Group(rank, 1, (MicroBatch((), est_time_s=cost.cluster.microbatch_overhead_s,
                                      est_mem_bytes=cost.static_bytes),))


def _place(bucket_sizes: list[int], D: int, limit: int) -> tuple[list[int], list[int], list[int]]:
    """(wave, first rank, final size) per bucket: buckets in order (largest CP size first) take
    the first wave with a free aligned block; then, per wave, the smallest groups double into
    free buddy blocks until none can."""
    wave_of, first_of, size_of = [], [], list(bucket_sizes)
    busy: list[list[bool]] = []
    cursor: dict[tuple[int, int], int] = {}   # (wave, size) -> first offset not yet known busy
    for size in bucket_sizes:
        for w, occupied in enumerate(busy):
            first = cursor.get((w, size), 0)
            while first + size <= D and any(occupied[first:first + size]):
                first += size
            cursor[(w, size)] = first
            if first + size <= D:
                break
        else:
            busy.append([False] * D)
            w, first = len(busy) - 1, 0
        busy[w][first:first + size] = [True] * size
        wave_of.append(w)
        first_of.append(first)
    for w, occupied in enumerate(busy):
        members = [b for b in range(len(bucket_sizes)) if wave_of[b] == w]
        grown = True
        while grown and not all(occupied):
            grown = False
            for b in sorted(members, key=lambda b: (size_of[b], first_of[b])):
                first, size = first_of[b], size_of[b]
                if size & (size - 1) or 2 * size > limit:
                    continue
                base = first - first % (2 * size)
                buddy = base + size if base == first else base
                if base + 2 * size <= D and not any(occupied[buddy:buddy + size]):
                    occupied[buddy:buddy + size] = [True] * size
                    first_of[b], size_of[b] = base, 2 * size
                    grown = True
    return wave_of, first_of, size_of
