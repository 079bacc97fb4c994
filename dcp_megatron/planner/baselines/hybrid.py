"""`megatron-hybrid`: Megatron-core's hybrid (dynamic) CP scheduler as published (docs/simulator.md).

- max tokens per rank: the setting's cap (the user's `max_seqlen_per_dp_cp_rank`; a
  `DynamicSetting`, tuned by planner/baselines/sweep.py in the simulator, else
  `default_dynamic_setting`);
- CP size of a sequence: the smallest power of two, or the whole domain (megatron-core builds a
  group "for every power of 2 of GPUs or the entire DPxCP group"), whose per-rank share of the
  sequence fits that;
- workload L²/c; per CP size, sequences longest-workload first into equal-work buckets of at
  most the per-rank token cap (as many buckets as tokens and the class's share of the
  domain need), dealt in serpentine order (least-worked-first when that would overflow);
- buckets fill waves (each wave = one Megatron micro-batch step over the whole domain) at the
  first free aligned block; idle ranks are then filled by doubling the smallest groups whose
  buddy block is free;
- no recompute choice: the setting's, run-wide (every bucket pays it; it must fit the cap).
Each group runs its bucket as one micro-batch (so PP > 1 holds naturally); ranks left idle in
a wave run an empty micro-batch with PP > 1 and nothing with PP = 1.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from dcp_megatron.planner.plan import NO_RECOMPUTE, Group, MicroBatch, Wave
from dcp_megatron.planner.layout import microbatch_from_sums, pow2_sizes
from dcp_megatron.planner.padding import local_tokens
from dcp_megatron.planner.list_scheduling import lpt_bins
from dcp_megatron.planner.baselines.settings import DynamicSetting, check_recompute_fits, default_dynamic_setting
from dcp_megatron.planner.timeline import one_microbatch_makespan


class HybridLayout(NamedTuple):
    """Where a batch's buckets run under a token cap; the run-wide recompute changes their times, not this."""
    bucket_of: np.ndarray        # bucket of each sequence
    wave_of: list[int]           # per bucket: wave, first rank, CP size once placed (doubled into free blocks)
    first_of: list[int]
    size_of: list[int]
    sums: np.ndarray             # (3, buckets): summed local tokens per rank, compute and attention seconds


def plan_megatron_hybrid(ids, lengths, cost, *, max_seq_len: int, packing=None, must_beat: float | None = None,
                         setting: DynamicSetting | None = None) -> tuple[Wave, ...] | None:
    """The plan's waves; None when `must_beat` is given and the plan would not be faster.
    `packing` (the static layout dcp's fallback shares) is not used: this scheduler has its own setting."""
    cluster = cost.cluster
    D = cluster.domain_size
    if setting is None:
        setting = cost.memoised(("hybrid_default", int(max_seq_len)), lambda: default_dynamic_setting(
            cost, max_seq_len, hybrid_cp_sizes(D, cluster.cp_size_limit)))
    check_recompute_fits(cost, setting.token_cap, setting.recompute, f"megatron-hybrid ({setting})")
    layout = hybrid_layout(lengths, cost, setting, must_beat)
    if layout is None:
        return None
    bucket_of, wave_of, first_of, size_of, sums = layout
    recompute = setting.recompute            # run-wide; buckets hold at most `cap` tokens per rank
    check_bucket_memory(cost, layout, setting)
    wave_arr, first_arr, size_arr = (np.asarray(x, dtype=np.int64) for x in (wave_of, first_of, size_of))
    run_order = np.lexsort((first_arr, wave_arr)).tolist()
    if must_beat is not None:
        times = cost.times_from_sums(sums[0], sums[1], sums[2], size_arr, first_arr, recompute)
        if one_microbatch_makespan(wave_arr, first_arr, size_arr, times, D) >= must_beat * (1 + 1e-9):
            return None
    local_s, compute_s, attn_s = (row.tolist() for row in sums)
    by_bucket = np.argsort(bucket_of, kind="stable")
    cuts = np.flatnonzero(np.diff(bucket_of[by_bucket])) + 1
    seqs = list(zip(ids.tolist(), lengths.tolist()))
    contents = [part.tolist() for part in np.split(by_bucket, cuts)]
    out: list[list[Group]] = [[] for _ in range(max(wave_of, default=0) + 1)]
    next_rank = [0] * len(out)
    for b in run_order:
        w, first, size = wave_of[b], first_of[b], size_of[b]
        out[w].extend(_idle(rank, cost, recompute) for rank in range(next_rank[w], first))
        mb = microbatch_from_sums(cost, tuple(map(seqs.__getitem__, contents[b])), local_s[b], compute_s[b],
                                  attn_s[b], size, first, recompute)
        out[w].append(Group(first, size, (mb,)))
        next_rank[w] = first + size
    for w, groups in enumerate(out):
        groups.extend(_idle(rank, cost, recompute) for rank in range(next_rank[w], D))
    return tuple(Wave(tuple(groups)) for groups in out)


def hybrid_layout(lengths, cost, setting: DynamicSetting, must_beat: float | None = None) -> HybridLayout | None:
    """The buckets of a batch and where they run (ValueError: a sequence fits no CP size under the cap); None
    when `must_beat` is given and the plan would not be faster. Without `must_beat` only the setting's cap
    matters (baselines/sweep.py times one layout under each recompute of a cap)."""
    cluster = cost.cluster
    D = cluster.domain_size
    sizes = hybrid_cp_sizes(D, cluster.cp_size_limit)
    cap = setting.token_cap
    cp = np.zeros(lengths.shape, dtype=np.int64)
    for s in reversed(sizes):
        cp[local_tokens(lengths, s) <= cap] = s
    if not cp.all():
        j = int(np.flatnonzero(cp == 0)[0])
        if must_beat is not None:
            return None
        raise ValueError(f"megatron-hybrid: a sequence of {int(lengths[j])} tokens fits no CP size up to "
                         f"{sizes[-1]} at {cap} tokens per rank")
    total_rank_tokens = float((local_tokens(lengths, 1)).sum())
    waves_needed = max(1, math.ceil(total_rank_tokens / (D * cap)))
    bucket_of = np.empty(lengths.size, dtype=np.int64)
    bucket_sizes: list[int] = []                 # CP size of each bucket, largest first
    classes = []
    for s in sorted(set(cp.tolist()), reverse=True):
        members = np.flatnonzero(cp == s)
        loc = local_tokens(lengths[members], s)
        share = float(loc.sum()) * s / total_rank_tokens
        count = max(1, min(len(members), max(math.ceil(float(loc.sum()) / cap), int(waves_needed * D * share / s))))
        classes.append((s, members, loc, count))
    longest = int(np.argmax(lengths))
    for s, members, loc, count in classes:
        work = lengths[members].astype(np.float64) ** 2 / s
        order = np.lexsort((members, -work))
        local_bucket, used = _equal_work_buckets(order, work, loc, cap, count)
        bucket_of[members] = len(bucket_sizes) + local_bucket
        bucket_sizes += [s] * used
        if must_beat is not None and cp[longest] == s:     # the rest cannot make the longest one's bucket faster
            stays = _longest_bucket_stays(lengths, members, bucket_of, bucket_sizes, classes, D, setting.recompute,
                                          cost)
            if stays >= must_beat * (1 + 1e-6):            # margin: these sums round differently from the plan's
                return None
    if must_beat is not None and _longest_bucket_time(lengths, bucket_of, bucket_sizes, cost) >= must_beat * (1 + 1e-9):
        return None
    wave_of, first_of, size_of = _place(bucket_sizes, D, cluster.cp_size_limit)
    num = len(bucket_sizes)
    final_size = np.asarray(size_of)[bucket_of]
    sums = np.zeros((3, num))
    for size in np.unique(final_size).tolist():
        sel = np.flatnonzero(final_size == size)
        for row, part in zip(sums, cost.doc_terms(lengths[sel], size)):
            row += np.bincount(bucket_of[sel], weights=part, minlength=num)
    return HybridLayout(bucket_of, wave_of, first_of, size_of, sums)


def check_bucket_memory(cost, layout: HybridLayout, setting: DynamicSetting) -> None:
    """ValueError unless the fullest bucket fits the memory budget with the setting's recompute."""
    recompute, most = setting.recompute, float(layout.sums[0].max())
    if cost.memory_from_tokens(most, recompute) > cost.cluster.mem_budget_bytes:
        raise ValueError(f"megatron-hybrid: a bucket of {int(most)} tokens per rank does not fit "
                         f"with recompute {recompute} (cap {setting.token_cap})")


def hybrid_cp_sizes(domain_size: int, limit: int) -> list[int]:
    """Powers of two up to `limit`, and the whole domain when it is allowed."""
    return sorted(set(pow2_sizes(limit)) | ({domain_size} if domain_size <= limit else set()))


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


def _idle(rank: int, cost, recompute) -> Group:
    """Nothing to run, or in lockstep an empty micro-batch (under ZeRO-3 with the run-wide recompute: it joins the
    wave's weight gathers)."""
    if not cost.model.lockstep:
        return Group(rank, 1, ())
    filler = recompute if cost.model.wave_uniform_relief else NO_RECOMPUTE
    return Group(rank, 1, (MicroBatch((), filler, est_time_s=cost.cluster.microbatch_overhead_s,
                                      est_mem_bytes=cost.static_bytes),))


def _longest_bucket_time(lengths, bucket_of: np.ndarray, bucket_sizes: list[int], cost) -> float:
    """A bound below the plan's step, before placement: the bucket holding the longest sequence
    runs at its size or, doubled, a larger power of two; recompute only adds time."""
    if cost.cluster.intra_node_bw < cost.cluster.inter_node_bw:
        return 0.0                       # first rank 0 (intra-node) would not be the fastest place
    bucket = int(bucket_of[int(np.argmax(lengths))])   # `members`: the class being bucketed, the longest's
    docs = lengths[bucket_of == bucket]
    size = bucket_sizes[bucket]
    grown = [size] if size & (size - 1) else [s for s in pow2_sizes(cost.cluster.cp_size_limit) if s >= size]
    return min(cost.time_from_sums(*(float(x.sum()) for x in cost.doc_terms(docs, s)), s, 0, NO_RECOMPUTE)
               for s in grown)


def _longest_bucket_stays(lengths, members: np.ndarray, bucket_of: np.ndarray, bucket_sizes: list[int], classes,
                          D: int, recompute, cost) -> float:
    """A bound below the plan's step as soon as the longest sequence's bucket is made (the later classes not yet
    bucketed): that bucket's time where it is placed, when it cannot double; else 0. With power-of-two sizes
    that divide D, `_place` lays the buckets out from rank 0 without gaps, so only the last wave has free ranks
    (from the total of the bucket sizes on, and each class makes at least min(count, members) buckets) and a
    bucket doubles only into a free buddy block."""
    sizes = np.array([s for s, _, _, _ in classes], dtype=np.int64)
    if (sizes & (sizes - 1)).any() or D % int(sizes.max()):
        return 0.0
    least_total = sum(s * min(count, members.size) for s, members, _, count in classes)
    bucket = int(bucket_of[int(np.argmax(lengths))])   # `members`: the class being bucketed, the longest's
    size = bucket_sizes[bucket]
    offset = sum(bucket_sizes[:bucket])
    wave, first = divmod(offset, D)
    if least_total < (wave + 1) * D and (first ^ size) >= least_total - wave * D:
        return 0.0                       # its buddy block may stay free: it may double
    terms = cost.doc_terms(lengths[members[bucket_of[members] == bucket]], size)
    local, compute, attn = (np.array([float(x.sum())]) for x in terms)
    return float(cost.times_from_sums(local, compute, attn, size, np.array([first]), recompute)[0])


def _place(bucket_sizes: list[int], D: int, limit: int) -> tuple[list[int], list[int], list[int]]:
    """(wave, first rank, final size) per bucket: buckets in order (largest CP size first) take
    the first wave with a free aligned block; then, per wave, the smallest groups double into
    free buddy blocks until none can."""
    sizes = np.asarray(bucket_sizes, dtype=np.int64)
    if sizes.size and not (sizes & (sizes - 1)).any() and D % int(sizes.max()) == 0:
        # Powers of two, largest first, all dividing D: first fit fills each wave from rank 0
        # without gaps before opening the next.
        offsets = np.cumsum(sizes) - sizes
        wave_of, first_of = (offsets // D).tolist(), (offsets % D).tolist()
        busy = [[False] * D for _ in range(int(offsets[-1]) // D + 1)]
        for w, first, size in zip(wave_of, first_of, bucket_sizes):
            busy[w][first:first + size] = [True] * size
    else:
        wave_of, first_of, busy = _first_fit(bucket_sizes, D)
    size_of = list(bucket_sizes)
    members_of: list[list[int]] = [[] for _ in busy]   # per wave, its buckets in order (one pass, not one per wave)
    for b, w in enumerate(wave_of):
        members_of[w].append(b)
    for occupied, members in zip(busy, members_of):
        _double_into_free(members, first_of, size_of, occupied, D, limit)
    return wave_of, first_of, size_of


def _first_fit(bucket_sizes: list[int], D: int) -> tuple[list[int], list[int], list[list[bool]]]:
    wave_of, first_of = [], []
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
    return wave_of, first_of, busy


def _double_into_free(members: list[int], first_of: list[int], size_of: list[int], occupied: list[bool],
                      D: int, limit: int) -> None:
    """Passes over the wave's groups, smallest first: a power-of-two group whose buddy block is
    free doubles into it. Occupancy only grows within a pass, so a group whose buddy is busy
    at the start of a pass stays put: each pass visits only the groups with a free buddy."""
    grown = True
    while grown and not all(occupied):
        grown = False
        firsts = np.asarray([first_of[b] for b in members], dtype=np.int64)
        sizes = np.asarray([size_of[b] for b in members], dtype=np.int64)
        base = firsts - firsts % (2 * sizes)
        buddy = np.where(base == firsts, base + sizes, base)
        used = np.concatenate(([0], np.cumsum(occupied)))
        free = ((sizes & (sizes - 1)) == 0) & (2 * sizes <= limit) & (base + 2 * sizes <= D)
        free &= used[np.minimum(buddy + sizes, D)] - used[np.minimum(buddy, D)] == 0
        candidates = [members[j] for j in np.flatnonzero(free).tolist()]
        for b in sorted(candidates, key=lambda b: (size_of[b], first_of[b])):
            first, size = first_of[b], size_of[b]
            base = first - first % (2 * size)
            buddy = base + size if base == first else base
            if not any(occupied[buddy:buddy + size]):
                occupied[buddy:buddy + size] = [True] * size
                first_of[b], size_of[b] = base, 2 * size
                grown = True
