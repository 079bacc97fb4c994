"""`dcp`: the batch's lengths decide CP sizes, packing, micro-batch counts and recompute.

1. CP size per sequence: the smallest allowed size at which it fits alone (full recompute
   at worst); then, longest first, a sequence that alone outlasts the perfectly balanced step
   (Σ rank-seconds / D) moves to the next larger size while that runs it faster and the
   extra rank-seconds keep the balanced step below the longest one (CP across nodes
   barely shortens short sequences but costs every rank). With PP = 1 a second sizing
   first moves sequences that need recompute up a size while that costs fewer rank-seconds
   (on more ranks each holds fewer tokens, often few enough to skip recompute); when the two
   sizings differ both are scheduled (step 2) and the shorter schedule wins, unless the
   second is already as short as the first could be.
2. PP = 1 — list scheduling: size classes largest first, each class's sequences longest
   first onto the aligned block of its size whose ranks are free earliest (LPT, decided in
   numpy rounds by `list_scheduling.lpt_assign_rounds`, the same result as a heap). Blocks of
   one power-of-two size class are always in sync, so no rank waits inside a block. A
   block's sequences become micro-batches next-fit up to the per-rank tokens that fit
   without recompute (few micro-batches: each pays a fixed overhead); a sequence too big
   for that runs alone with the fastest recompute that fits. Groups become waves in
   execution order (`assemble_waves`), so ranks run variable micro-batch counts.
   Then odd_groups.py: the longest sequences may instead run first on non-power-of-two groups
   (fewer rank-seconds than their power of two), the rest scheduled after, if that ends sooner.
3. PP > 1 — see pipeline.py.
"""
from __future__ import annotations

import numpy as np

from dcp_megatron.planner.plan import NO_RECOMPUTE, Group, MicroBatch, Wave
from dcp_megatron.planner.list_scheduling import lpt_assign_rounds
from dcp_megatron.planner.layout import (assemble_waves, candidate_sizes, microbatches_from_sums,
                                          min_fitting_size)
from dcp_megatron.planner.dcp.odd_groups import odd_group_alternative
from dcp_megatron.planner.dcp.packing_rounds import MIN_BLOCKS, first_fit_rounds, python_sums
from dcp_megatron.planner.dcp.sized_sequences import SizedSequences


WHOLE_DOMAIN_LIMIT = 64     # the whole-domain candidate is tried on domains up to this size (planning time)


def plan_dcp(ids: np.ndarray, lengths: np.ndarray, cost, *, max_seq_len: int) -> tuple[Wave, ...]:
    if cost.model.lockstep:
        from dcp_megatron.planner.dcp.pipeline import plan_dcp_pipeline
        return plan_dcp_pipeline(ids, lengths, cost)
    D = cost.cluster.domain_size
    sizes = candidate_sizes(cost.cluster)
    top = len(sizes) - 1
    fitting = SizedSequences(lengths, sizes, min_fitting_size(lengths, ids, sizes, cost), cost)
    cheaper = fitting.copy()
    moved = cheaper.grow_cheaper(top)
    fitting.grow_long_sequences(D, top)
    if moved:
        cheaper.grow_long_sequences(D, top)
    # nothing moved, or the long-sequence growth moved the same sequences anyway: one sizing
    if not moved or np.array_equal(cheaper.idx, fitting.idx):
        makespan, _, groups = _list_schedule(ids, lengths, cost, fitting)
        makespan, groups, fitting = _whole_domain_alternative(ids, lengths, cost, fitting, makespan, groups)
        return assemble_waves(D, odd_group_alternative(ids, lengths, cost, fitting, makespan, groups, _list_schedule))
    makespan, busy, groups = _list_schedule(ids, lengths, cost, cheaper)
    chosen = cheaper
    # Fewer rank-seconds usually mean a shorter step, but larger groups are coarser to balance (on
    # a few ranks that can lose): schedule the smallest-fitting sizes too, unless this schedule
    # already ends when theirs would at best (its busy rank-seconds plus the ones it saved, spread
    # perfectly).
    saved = fitting.rank_seconds() - cheaper.rank_seconds()
    if makespan > (busy + saved) / D:
        other_makespan, _, other_groups = _list_schedule(ids, lengths, cost, fitting)
        if other_makespan < makespan:
            makespan, groups, chosen = other_makespan, other_groups, fitting
    makespan, groups, chosen = _whole_domain_alternative(ids, lengths, cost, chosen, makespan, groups)
    return assemble_waves(D, odd_group_alternative(ids, lengths, cost, chosen, makespan, groups, _list_schedule))


def _whole_domain_alternative(ids, lengths, cost, seqs: SizedSequences, makespan: float, groups: list[Group]):
    """Every sequence on one whole-domain group instead, packed next-fit with each micro-batch's cheapest relief,
    where that ends sooner (on a few ranks one group wastes no rank on balance; the sizing rules above grow
    only the long sequences). Returns (makespan, groups, sizing)."""
    top = len(seqs.sizes) - 1
    if seqs.sizes[top] != cost.cluster.domain_size or seqs.sizes[top] > WHOLE_DOMAIN_LIMIT or (seqs.idx == top).all():
        return makespan, groups, seqs
    whole = SizedSequences(lengths, seqs.sizes, np.full(lengths.size, top), cost)
    if not np.isfinite(whole.seconds).all():
        return makespan, groups, seqs
    other, _, other_groups = _list_schedule(ids, lengths, cost, whole)
    return (other, other_groups, whole) if other < makespan else (makespan, groups, seqs)


def _list_schedule(ids: np.ndarray, lengths: np.ndarray, cost, seqs: SizedSequences,
                   finish: np.ndarray | None = None) -> tuple[float, float, list[Group]]:
    """(makespan, busy rank-seconds, groups in execution order): the list schedule of `seqs`, after
    ranks already busy until `finish` (default: all free at 0)."""
    D, sizes = cost.cluster.domain_size, seqs.sizes
    none_allowed = cost.base_recompute is NO_RECOMPUTE and not cost.time_scale   # measured: compare every relief
    pairs = list(zip(ids.tolist(), lengths.tolist()))
    local, compute, attn = seqs.local.tolist(), seqs.compute.tolist(), seqs.attn.tolist()
    finish = np.zeros(D) if finish is None else np.array(finish, dtype=np.float64)
    busy_rank_seconds = 0.0
    scheduled: list[Group] = []
    for k in range(len(sizes) - 1, -1, -1):
        members = np.flatnonzero(seqs.idx == k)
        if not members.size:
            continue
        size = sizes[k]
        cap_none = cost.max_local_tokens(cost.base_recompute, size)   # packing room without (extra) recompute
        mem_per_token = cost.bytes_per_local_token(NO_RECOMPUTE, size)
        members = members[np.lexsort((ids[members], -seqs.seconds[members]))]
        num_blocks = (D - size) // size + 1
        starts = finish[:num_blocks * size].reshape(num_blocks, size).max(axis=1)
        where, _ = lpt_assign_rounds(seqs.seconds[members], starts)
        by_block = np.argsort(where, kind="stable")
        blocks = where[by_block]
        cuts = np.flatnonzero(np.diff(blocks)) + 1
        used = blocks[np.concatenate(([0], cuts))]                  # blocks that got sequences
        block_local, block_compute, block_attn = (
            np.bincount(where, weights=arr[members], minlength=num_blocks)[used]
            for arr in (seqs.local, seqs.compute, seqs.attn))
        firsts = used * size
        # the usual case, one micro-batch per block without recompute: estimates vectorised
        times = cost.times_from_sums(block_local, block_compute, block_attn, size, firsts, NO_RECOMPUTE)
        mems = (cost.static_bytes + np.ceil(block_local * mem_per_token)).astype(np.int64).tolist()
        busy = times.copy()
        ordered = members[by_block].tolist()
        ordered_pairs = list(map(pairs.__getitem__, ordered))
        lows, highs = [0] + cuts.tolist(), cuts.tolist() + [len(ordered)]
        # without "none" allowed every block takes the per-micro-batch path (fastest allowed choice)
        fits = (block_local <= cap_none).tolist() if none_allowed else [False] * len(used)
        block_mbs: list = [None] * len(used)
        chunks, chunk_block = [], []            # (first rank, sequences, local, compute, attention sums), its block
        packed = []                             # blocks packed into micro-batches
        for j, (lo, hi, t, mem) in enumerate(zip(lows, highs, times.tolist(), mems)):
            if fits[j]:
                block_mbs[j] = (MicroBatch(tuple(ordered_pairs[lo:hi]), NO_RECOMPUTE, t, mem),)
            else:
                packed.append(j)
        if len(packed) >= MIN_BLOCKS:           # many blocks: first fit and sums in numpy rounds (the same floats)
            chunks, chunk_block = _packed_chunks(members[by_block], np.array(packed), np.array(lows),
                                                 np.array(highs), firsts, seqs, pairs, cap_none)
        else:
            for j in packed:
                lo, hi, first = lows[j], highs[j], int(firsts[j])
                for chunk in _next_fit(ordered[lo:hi], local, cap_none):
                    chunks.append((first, tuple(map(pairs.__getitem__, chunk)), sum(map(local.__getitem__, chunk)),
                                   sum(map(compute.__getitem__, chunk)), sum(map(attn.__getitem__, chunk))))
                    chunk_block.append(j)
        per_block: dict[int, list] = {}
        for j, mb in zip(chunk_block, microbatches_from_sums(cost, chunks, size)):
            per_block.setdefault(j, []).append(mb)
        for j, mbs in per_block.items():
            block_mbs[j] = tuple(mbs)
            busy[j] = sum(mb.est_time_s for mb in mbs)
        scheduled += [Group(first, size, mbs) for first, mbs in zip(firsts.tolist(), block_mbs)]
        end = starts[used] + busy
        busy_rank_seconds += float(busy.sum()) * size
        if size == 1:
            finish[firsts] = end
        else:
            finish[:num_blocks * size].reshape(num_blocks, size)[used] = end[:, None]
    return float(finish.max()), busy_rank_seconds, scheduled


def _packed_chunks(ordered: np.ndarray, packed: np.ndarray, lows: np.ndarray, highs: np.ndarray,
                   firsts: np.ndarray, seqs: SizedSequences, pairs: list, room: float) -> tuple[list, list[int]]:
    """The `packed` blocks' micro-batches as `_list_schedule`'s chunks and their blocks, `_next_fit` and Python's
    sums of each block's sequences (`ordered[lows[j]:highs[j]]`) decided in numpy rounds (packing_rounds.py)."""
    counts = highs[packed] - lows[packed]
    offsets = np.cumsum(counts) - counts
    seq = ordered[np.arange(int(counts.sum())) - np.repeat(offsets - lows[packed], counts)]
    chunk = first_fit_rounds(seqs.local[seq], offsets, counts, room)
    block = np.repeat(np.arange(packed.size), counts)
    by_chunk = np.argsort(block * (int(chunk.max()) + 1) + chunk, kind="stable")
    seq, block, chunk = seq[by_chunk], block[by_chunk], chunk[by_chunk]
    starts = np.flatnonzero(np.r_[True, (np.diff(block) != 0) | (np.diff(chunk) != 0)])
    sizes = np.diff(np.r_[starts, seq.size])
    sums = python_sums(np.stack([seqs.local[seq], seqs.compute[seq], seqs.attn[seq]]), starts, sizes)
    seq_list, chunk_block = seq.tolist(), packed[block[starts]].tolist()
    chunk_first = firsts[chunk_block].tolist()
    chunks = [(first, tuple(map(pairs.__getitem__, seq_list[lo:lo + n])), loc, comp, att)
              for first, lo, n, loc, comp, att in zip(chunk_first, starts.tolist(), sizes.tolist(), *sums.tolist())]
    return chunks, chunk_block


def _next_fit(items: list[int], local: list[float], room: float) -> list[list[int]]:
    """Micro-batches of `items` (longest first) up to `room` local tokens each: first fit, so a short sequence
    fills an earlier micro-batch's gap (fewer micro-batches, each paying the fixed overhead)."""
    if len(items) == 1:
        return [items]
    chunks: list[list[int]] = []
    used: list[float] = []
    for i in items:
        for j, u in enumerate(used):
            if u + local[i] <= room:
                chunks[j].append(i)
                used[j] += local[i]
                break
        else:
            chunks.append([i])
            used.append(local[i])
    return chunks
