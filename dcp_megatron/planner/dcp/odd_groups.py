"""`dcp`'s non-power-of-two groups: the longest documents on group sizes between the powers of two.

On aligned power-of-two groups alone a long document often pays for a group size it cannot use: a
650K-token document on 64 H200s needs 64 (on 32 it needs recompute) but runs without recompute on
42 for ~5% fewer rank-seconds. Up to MAX_ODD documents, longest first, each get the size with the
fewest rank-seconds among: half-node steps between the powers of two below and above its own, and the
fewest ranks that hold it without recompute (and one more). They run first, side by side from rank 0
(each group contiguous; the runtime creates non-power-of-two communicators on first use); CP-1
sequences fill every rank until the last of them ends, and the rest of the batch is list-scheduled
after that. The alternative is kept only when its makespan is shorter, so it never makes a plan
worse; it is tried only when the saved rank-seconds are at least MIN_GAIN of the step's.
"""
from __future__ import annotations

import heapq
import itertools

import numpy as np

from dcp_megatron.planner.plan import Group
from dcp_megatron.planner.layout import microbatch_from_sums, microbatches_from_sums
from dcp_megatron.planner.dcp.packing_rounds import numpy_sums

MIN_GAIN = 0.002
MAX_CANDIDATES = 8
MAX_ODD = 4            # documents tried on odd groups, longest first


def odd_group_alternative(ids: np.ndarray, lengths: np.ndarray, cost, seqs, makespan: float, groups: list,
                          list_schedule) -> list:
    """`groups` (a schedule of `seqs` ending at `makespan`), or a shorter one that runs the longest
    documents on non-power-of-two groups first; `list_schedule` is dcp's, taking initial rank finish times."""
    D = cost.cluster.domain_size
    if lengths.size < 2:
        return groups
    chosen, first, gain = [], 0, 0.0        # (document, size, first rank) side by side from rank 0
    for j in np.argsort(-lengths, kind="stable")[:MAX_ODD].tolist():
        pick = _odd_size(j, lengths, cost, seqs, makespan, D - first)
        if pick is None:
            break
        chosen.append((j, pick[1], first))
        first += pick[1]
        gain += pick[0]
    if not chosen or gain < MIN_GAIN * D * makespan:
        return groups
    finish = np.zeros(D)
    odd = []
    for j, c, r in chosen:
        local, compute, attn = (float(x[0]) for x in cost.doc_terms(lengths[j:j + 1], c))
        mb = microbatch_from_sums(cost, ((int(ids[j]), int(lengths[j])),), local, compute, attn, c, r)
        finish[r:r + c] = mb.est_time_s
        odd.append(Group(r, c, (mb,)))
    rest = np.ones(lengths.size, dtype=bool)
    rest[[j for j, _, _ in chosen]] = False
    chunks = _fill_beside(ids, cost, seqs, rest, float(finish.max()), finish)
    keep = np.flatnonzero(rest)
    other_makespan, _, other_groups = list_schedule(ids[keep], lengths[keep], cost, seqs.subset(keep), finish)
    if other_makespan < makespan * (1 - 1e-9):
        return odd + _filler_groups(ids, lengths, cost, seqs, chunks) + other_groups
    return groups


def _odd_size(j: int, lengths: np.ndarray, cost, seqs, makespan: float, free: int) -> tuple[float, int] | None:
    """(rank-seconds saved, size) of document j's best non-power-of-two size of at most `free` ranks, or None."""
    D, node = cost.cluster.domain_size, cost.cluster.gpus_per_node
    overhead = cost.cluster.microbatch_overhead_s
    k = int(seqs.idx[j])
    if k == 0:
        return None
    now = seqs.sizes[k] * (seqs.seconds[j] + overhead)
    # no group size runs it in fewer rank-seconds than its CP-1 compute: too little to gain, stop here
    if now - float(cost.ideal_doc_seconds(lengths[j:j + 1])[0][0]) < MIN_GAIN * D * makespan / MAX_ODD:
        return None
    step = max(1, node // 2)
    upper = seqs.sizes[min(k + 1, len(seqs.sizes) - 1)]
    candidates = list(range(seqs.sizes[k - 1] + step, upper, step))
    if len(candidates) > MAX_CANDIDATES:       # evenly spread, at most MAX_CANDIDATES sizes
        candidates = [candidates[i] for i in np.linspace(0, len(candidates) - 1, MAX_CANDIDATES).astype(int)]
    # and the fewest ranks that hold it without recompute (often the best: fewer need it, more cost rank-seconds)
    room = cost.max_local_tokens(cost.base_recompute)
    fewest = -(-int(lengths[j]) // max(2 * (room // 2), 2))
    candidates = sorted({c for c in candidates + [fewest, fewest + 1]
                         if seqs.sizes[k - 1] < c < upper and c & (c - 1) and c <= free})
    best = None
    for c in candidates:
        t = float(cost.doc_alone_seconds(lengths[j:j + 1], c)[3][0]) + overhead
        # it must gain rank-seconds and end before the current plan (the odd group runs alone on its ranks)
        if c * t < now and t < makespan and (best is None or now - c * t > best[0]):
            best = (now - c * t, c)
    return best


def _fill_beside(ids, cost, seqs, rest: np.ndarray, until: float, finish: np.ndarray) -> dict:
    """CP-1 sequences, longest first, onto the least-loaded rank (busy until `finish`) while they end by
    `until` (the last odd group's end: larger groups straddling it start then anyway). Marks them done in `rest`,
    sets those ranks' `finish` (an estimate: the sequences' alone-times plus one overhead per
    micro-batch) and returns {rank: micro-batches as lists of sequence indices, packed next-fit}."""
    D = cost.cluster.domain_size
    ones = np.flatnonzero(rest & (seqs.idx == 0))
    ones = ones[np.lexsort((ids[ones], -seqs.seconds[ones]))]
    overhead = cost.cluster.microbatch_overhead_s
    room = cost.max_local_tokens(cost.base_recompute)
    heap = [(float(finish[r]), r) for r in range(D) if finish[r] < until]
    if not heap:
        return {}
    chunks: dict[int, list[list[int]]] = {}
    used = [room] * D                   # local tokens in each rank's open micro-batch
    shortest = float(seqs.seconds[ones[-1]]) if ones.size else 0.0
    for i, t, tokens in zip(ones.tolist(), seqs.seconds[ones].tolist(), seqs.local[ones].tolist()):
        load, r = heap[0]
        if load + shortest > until:     # no rank takes even the shortest one any more
            break
        opens = used[r] + tokens > room
        added = t + overhead if opens else t
        if load + added > until:
            continue
        if opens:
            chunks.setdefault(r, []).append([])
            used[r] = 0.0
        chunks[r][-1].append(i)
        used[r] += tokens
        heapq.heapreplace(heap, (load + added, r))
    for load, r in heap:
        finish[r] = load
    for rank_chunks in chunks.values():
        for chunk in rank_chunks:
            rest[chunk] = False
    return chunks


def _filler_groups(ids, lengths, cost, seqs, chunks: dict) -> list:
    pairs = list(zip(ids.tolist(), lengths.tolist()))
    ranks, members = [], []             # the micro-batches of every rank at once (microbatches_from_sums)
    for r, rank_chunks in sorted(chunks.items()):
        ranks += [r] * len(rank_chunks)
        members += rank_chunks
    counts = np.array([len(chunk) for chunk in members], dtype=np.int64)
    every = np.fromiter(itertools.chain.from_iterable(members), dtype=np.int64, count=int(counts.sum()))
    # each chunk's numpy sums, float for float, without a numpy call per chunk
    sums = numpy_sums(np.stack([seqs.local[every], seqs.compute[every], seqs.attn[every]]),
                      np.cumsum(counts) - counts, counts).tolist()
    flat = [(r, tuple(map(pairs.__getitem__, chunk)), loc, comp, att)
            for r, chunk, loc, comp, att in zip(ranks, members, *sums)]
    per_rank: dict[int, list] = {}
    for r, mb in zip(ranks, microbatches_from_sums(cost, flat, 1)):
        per_rank.setdefault(r, []).append(mb)
    return [Group(r, 1, tuple(mbs)) for r, mbs in per_rank.items()]
