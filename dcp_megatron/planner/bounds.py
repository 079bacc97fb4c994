"""A lower bound on any plan's step time for one batch (docs/simulator.md), memory-aware.

max( balanced: every document's least rank-seconds, plus the overhead of the fewest micro-batches
     memory allows and the MoE all-to-alls every token pays, summed and divided by the D ranks —
     perfect balance, no other communication; a
     document's least rank-seconds is the minimum over group sizes c of c x (its compute at c + the
     least recompute it needs there even alone in a micro-batch),
     longest: the longest sequence alone in a micro-batch on its best allowed group size — it
     has to run somewhere, with the fastest recompute that fits there; every group size counts,
     not only the policies' (a 20K-token document runs faster on 63 ranks than on 32 or 64) )

Why the balanced term holds: a rank's busy time is the sum of its micro-batches' compute and
recompute; a micro-batch holds at least the local tokens of each of its documents, so the
recompute it needs costs at least what each document alone would need (recompute extra is linear
in the compute it reruns), and a group of c ranks spends c rank-seconds per second.
Every rank of a group pays the per-micro-batch overhead, and no rank's share of a micro-batch
holds more local tokens than the strongest allowed recompute fits, M; the ranks' shares add up to
at least the batch's tokens, so every plan runs at least ceil(tokens / M) rank-micro-batches.
Group sizes up to 64, those the policies use (powers of two, divisors of the domain, the limit) and
a geometric grid above 64 are scored exactly (`scored_sizes`); any other size c' in a gap [lo, hi]
is bounded from below by the unpadded linear work plus the attention at the fastest rate a chunk of
L/hi .. L/lo + 2 tokens reaches (padding only adds tokens), plus the least recompute that fits L/hi
local tokens (fewer local tokens than at c', so no more recompute). (Scoring only the policies' sizes
and charging the gaps the c = 1 compute let sizes such as 33..63 look like a 0.65M-token document
runs at its full-length attention rate without recompute: 614 rank-seconds where no group size
does it in under 667 (c = 42), and ByteScale-like steps bounded 7-9% too low.) A document that needs
no recompute even at c = 1 is charged its c = 1 compute (the same argument), without the search.

Without the memory term, a batch whose documents mostly exceed what one rank holds without
recompute gets a bound no plan can approach (DCP would then look further from optimal than it is).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from dcp_megatron.planner.plan import Recompute
from dcp_megatron.planner.layout import candidate_sizes, check_batch, check_static_memory, divisor_sizes

# a bound must never exceed a real plan: judge "fits" with a hair of slack against float rounding
FIT_SLACK = 1.0 + 1e-9
EXACT_SIZES = 64          # group sizes up to this are scored exactly (see scored_sizes)
GRID_RATIO = 1.0625       # above it, the scored sizes grow by at most this ratio


def lower_bound(batch: Sequence[tuple[int, int]], cost) -> float:
    """Seconds no plan of this batch can beat (ValueError on a malformed batch)."""
    return lower_bound_of_lengths(check_batch(batch)[1], cost)


def lower_bound_of_lengths(lengths: np.ndarray, cost) -> float:
    check_static_memory(cost)
    overhead = cost.cluster.microbatch_overhead_s * fewest_rank_microbatches(lengths, cost)
    # every token passes each MoE layer's all-to-alls at least once per pass, whatever its group (padding adds)
    moe_comm = float(cost.moe.seconds(float(np.sum(lengths))))
    balanced = (float(least_rank_seconds(lengths, cost).sum()) + overhead + moe_comm) / cost.cluster.domain_size
    best = fastest_alone_time(int(lengths.max()), cost)
    if math.isinf(best):
        raise ValueError(f"a sequence of {int(lengths.max())} tokens fits no allowed CP group "
                         f"(cp_size_limit {cost.cluster.cp_size_limit}) even with the strongest allowed recompute")
    return max(balanced, best)


def fastest_alone_time(length: int, cost) -> float:
    """Seconds no group runs the document in, alone in a micro-batch (inf: it fits none): the policies'
    sizes exactly (first rank 0: inside a node when the size fits one, the fastest placement; the fastest
    recompute that fits); any other scored size at least the overhead plus its rank-seconds (compute and
    least recompute, no communication) over its ranks; a size in a gap [lo, hi] at least the overhead plus
    the gap's rank-seconds floor (_least_over_sizes' relaxed form) over hi ranks."""
    fastest = min(alone_times(length, candidate_sizes(cost.cluster), cost).values(), default=math.inf)
    sizes = np.asarray(scored_sizes(cost.cluster), dtype=np.int64)
    overhead = cost.cluster.microbatch_overhead_s
    scale = min([1.0] + list(cost.time_scale.values()))        # measured factors below 1 shorten any time
    if cost.time._attn_table:
        rank_seconds = np.array([_exact_rank_seconds(doc, int(c), cost)[0] for c in sizes.tolist()])
    else:
        rank_seconds = _exact_rank_seconds(np.full(sizes.shape, length), sizes, cost)
    fastest = min(fastest, float((scale * (overhead + rank_seconds / sizes)).min()))
    previous = np.r_[0, sizes[:-1]]
    gap = sizes > previous + 1
    if gap.any():
        lo, hi = previous[gap] + 1, sizes[gap] - 1
        column = np.array([[float(length)]])
        ideal_compute, ideal_attn = (x.reshape(1, 1) for x in cost.ideal_doc_seconds(column[0]))
        floor_compute, floor_attn = _compute_floor(column, lo[None, :], hi[None, :], ideal_compute, ideal_attn, cost)
        floor = floor_compute + least_recompute_extra(column / hi[None, :], floor_compute, floor_attn, cost)
        fastest = min(fastest, float((scale * (overhead + floor / hi[None, :])).min()))
    return fastest


def exact_alone_time(length: int, cost) -> float:
    """Seconds no plan runs the document in: alone in a micro-batch on every group size 1..cp_size_limit (first rank 0,
    each size's fastest placement: inside a node where it fits one), the fastest relief that fits (inf: it fits none).
    `fastest_alone_time` scores the sizes between its grid's without their CP communication; at scale that
    communication is most of a long document's time (each rank receives about its whole K/V whatever the group size:
    a 1.2M-token document takes at least 9.4 s on any of 16,384 ranks' group sizes where that floor says 1.7-2.3 s).
    ~40 µs a size, 0.6 s at 16,384 ranks: for offline tools (tools/bound_gap.py --exact-longest), not per plan."""
    return min(alone_times(length, range(1, cost.cluster.cp_size_limit + 1), cost).values(), default=math.inf)


def alone_times(length: int, sizes, cost) -> dict[int, float]:
    """The document alone in a micro-batch on a group of each of `sizes` at first rank 0 with the fastest relief
    that fits (sizes it fits none of left out)."""
    doc, times = np.array([length]), {}
    for size in sizes:
        local, compute, attn = (float(x[0]) for x in cost.doc_terms(doc, size))
        relief = cost.best_recompute_from_sums(local, compute, attn, size)
        if relief is not None:
            times[size] = cost.time_from_sums(local, compute, attn, size, 0, relief)
    return times


def fewest_rank_microbatches(lengths, cost) -> int:
    """Rank-micro-batches any plan needs: the batch's tokens over the most local tokens one fits."""
    room = (cost.cluster.mem_budget_bytes - cost.static_bytes) * FIT_SLACK
    most_local = room / cost.bytes_per_local_token(cost.strongest_recompute)
    return max(1, math.ceil(float(np.sum(lengths)) / most_local * (1 - 1e-12)))


def least_rank_seconds(lengths, cost) -> np.ndarray:
    """Per document: the fewest rank-seconds of compute and recompute any group size runs it in."""
    lengths = np.asarray(lengths, dtype=np.int64)
    ideal_compute, ideal_attn = cost.ideal_doc_seconds(lengths)
    # at CP size 1 unpadded (fewest local tokens a size-1 group can have): a document that needs no
    # recompute there gets the compute-only bound, and only the others (usually few) search the sizes
    alone = ideal_compute + least_recompute_extra(lengths.astype(np.float64), ideal_compute, ideal_attn, cost)
    heavy = ~(alone <= ideal_compute)
    if heavy.any():
        alone[heavy] = _least_over_sizes(lengths[heavy], ideal_compute[heavy], ideal_attn[heavy], cost)
    return alone


def _least_over_sizes(lengths: np.ndarray, ideal_compute: np.ndarray, ideal_attn: np.ndarray, cost) -> np.ndarray:
    # documents that fit nowhere keep inf here; lower_bound_of_lengths names the longest of them.
    # One (documents x sizes) array per form; measured attention times take one cp size at a time.
    sizes = np.asarray(scored_sizes(cost.cluster), dtype=np.int64)
    previous = np.r_[0, sizes[:-1]]
    gap = sizes > previous + 1          # sizes strictly between previous and size: the relaxed form
    lo, hi = previous[gap] + 1, sizes[gap] - 1
    column = lengths[:, None]
    if cost.time._attn_table:
        exact = np.column_stack([_exact_rank_seconds(lengths, int(c), cost) for c in sizes.tolist()])
    else:
        exact = _exact_rank_seconds(column, sizes[None, :], cost)
    best = exact.min(axis=1)
    if gap.any():
        compute, attn = _compute_floor(column, lo[None, :], hi[None, :], ideal_compute[:, None],
                                       ideal_attn[:, None], cost)
        relaxed = compute + least_recompute_extra(column / hi[None, :], compute, attn, cost)
        best = np.minimum(best, relaxed.min(axis=1))
    return best


def _exact_rank_seconds(lengths, sizes, cost) -> np.ndarray:
    local, compute, attn = cost.doc_terms(lengths, sizes)
    return sizes * (compute + least_recompute_extra(local, compute, attn, cost))


def scored_sizes(cluster) -> list[int]:
    """Group sizes the bound scores exactly (ascending): every size up to EXACT_SIZES, the sizes the
    policies use, and a geometric grid (ratio GRID_RATIO) up to the limit; the gaps get the relaxed form."""
    limit = cluster.cp_size_limit
    sizes = set(range(1, min(limit, EXACT_SIZES) + 1)) | set(candidate_sizes(cluster)) | set(divisor_sizes(cluster))
    c = float(EXACT_SIZES)
    while c < limit:
        sizes.add(int(c))
        c *= GRID_RATIO
    return sorted(x for x in sizes if x <= limit)


def _compute_floor(lengths: np.ndarray, lo: np.ndarray, hi: np.ndarray, ideal_compute: np.ndarray, ideal_attn: np.ndarray,
                   cost) -> tuple[np.ndarray, np.ndarray]:
    """Per document (rows) and gap [lo, hi] (columns): (compute, attention) rank-seconds no group size c in
    [lo, hi] beats: padding only adds
    tokens (linear part and L² at least the unpadded document's); the attention of a rank's chunk
    (between L/hi and L/lo + 2 tokens) runs at no more than the fastest rate over that range of chunk
    lengths. With measured attention times the rank-seconds are t(padded length) x the profile's cp row,
    and that row (the largest listed cp size <= c) only grows with c: charge t(L) x the row of lo."""
    linear = ideal_compute - ideal_attn
    lengths = lengths.astype(np.float64)
    if cost.time._attn_table:
        attn = np.column_stack([c * cost.time._attention_seconds(lengths[:, 0], c) for c in lo.ravel().tolist()])
        return linear + attn, attn
    log_len, rates = cost.time._rate_log_len, cost.time._rate_values
    shortest = np.log(np.maximum(lengths / hi, 1.0))
    longest = np.log(lengths / lo + 2.0)
    fastest = np.maximum(np.interp(shortest, log_len, rates), np.interp(longest, log_len, rates))
    for x, r in zip(log_len.tolist(), rates.tolist()):     # an interior rate point can be the fastest
        fastest = np.where((shortest <= x) & (x <= longest), np.maximum(fastest, r), fastest)
    attn = cost.time._attn_flops_per_len2 * lengths ** 2 / fastest
    return linear + attn, attn


def least_recompute_extra(local: np.ndarray, compute: np.ndarray, attn: np.ndarray, cost) -> np.ndarray:
    """Per micro-batch (vectorised): the smallest added recompute seconds among the allowed
    recompute policies whose memory fits `local` tokens per rank; inf where none fits."""
    room = (cost.cluster.mem_budget_bytes - cost.static_bytes) * FIT_SLACK
    best = np.full(np.shape(local), math.inf)
    for option in cost.recompute_options():
        if option.kind == "full":
            continue
        # offload's exposed PCIe time shrinks as compute grows: counted as 0 here, so the floor stays one
        modules_only = Recompute(option.kind, modules=option.modules)
        extra, _ = cost.recompute_extra(compute, attn, modules_only, local)
        best = np.where(local * cost.bytes_per_local_token(option) <= room, np.minimum(best, extra), best)
    if "full" in cost.allowed_recompute:
        # memory falls as the number k of recomputed layers grows, the extra rises with k: the fewest that fit
        options = cost.full_recompute_options()
        full_bytes = cost.full_recompute_bytes()
        fewest = np.searchsorted(-full_bytes, -room / np.maximum(local, 1e-300), side="left")
        if not cost.memory.full_bytes_fall():     # they may rise with k (relief_choice.py): the first that fits
            fits_k = np.asarray(local)[..., None] * full_bytes <= room
            fewest = np.where(fits_k.any(axis=-1), fits_k.argmax(axis=-1), len(options))
        fits = fewest < len(options)
        extra = cost.full_recompute_seconds(compute, np.minimum(fewest, len(options) - 1) + 1)
        best = np.where(fits, np.minimum(best, extra), best)
    return best
