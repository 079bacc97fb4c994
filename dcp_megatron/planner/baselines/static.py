"""Megatron's default layout and its balanced variant (docs/simulator.md).

`static`: one (CP size c, recompute) pair for the whole run (a `StaticSetting`). The simulator
gives it the pair with the lowest mean step over the run's batches (planner/baselines/sweep.py).
Without a setting (the default, also dcp's fallback): among CP sizes dividing D, with the fastest
recompute with which a micro-batch holding one sequence of the run's length cap fits, the pair
with the fewest rank-seconds for two full micro-batches: that longest sequence, and the same
capacity packed with `TYPICAL_DOC_LEN`-token documents. Sequences are packed in
order into micro-batches of the cap's padded tokens
(each sequence padded to 2c), micro-batches are dealt round-robin to the D/c replicas. With
PP = 1 counts may differ by one between replicas (the tail replicas run one fewer); with
PP > 1 the tail is filled with empty micro-batches so every group runs one per wave.
`static-balanced`: the same micro-batches, dealt by cost: longest first to the least loaded
replica that still has fewer than ceil(n / replicas) (equal counts, as Megatron's dp-balanced).
"""
from __future__ import annotations

import heapq
import math
from typing import NamedTuple

import numpy as np

from dcp_megatron.planner.plan import Group, Recompute, Wave
from dcp_megatron.planner.layout import divisor_sizes, microbatch_from_sums
from dcp_megatron.planner.padding import local_tokens
from dcp_megatron.planner.baselines.settings import StaticSetting, check_recompute_fits


TYPICAL_DOC_LEN = 4096   # a common pretraining sequence length


class StaticLayout(NamedTuple):
    cp_size: int
    recompute: Recompute
    capacity_local_tokens: int   # padded tokens per rank of a full micro-batch


def static_layout(cost, max_seq_len: int, setting: StaticSetting | None = None) -> StaticLayout:
    """The run's layout for this length cap: the setting's, else the default (once per cost model and cap)."""
    if setting is not None:
        return cost.memoised(("static_layout", int(max_seq_len), setting),
                             lambda: _layout_of(cost, int(max_seq_len), setting))
    return cost.memoised(("static_layout", int(max_seq_len)), lambda: _choose_layout(cost, int(max_seq_len)))


def _layout_of(cost, max_seq_len: int, setting: StaticSetting) -> StaticLayout:
    c = setting.cp_size
    if c not in divisor_sizes(cost.cluster):
        raise ValueError(f"static: CP size {c} does not divide the domain ({cost.cluster.domain_size}) "
                         f"or exceeds the max CP size {cost.cluster.cp_size_limit}")
    capacity = int(local_tokens(np.array([max_seq_len]), c)[0])
    check_recompute_fits(cost, capacity, setting.recompute, f"static at CP {c} (max_seq_len {max_seq_len})")
    return StaticLayout(c, setting.recompute, capacity)


def _choose_layout(cost, max_seq_len: int) -> StaticLayout:
    best = None
    for c in divisor_sizes(cost.cluster):
        local, compute, attn = (float(x[0]) for x in cost.doc_terms(np.array([max_seq_len]), c))
        rc = cost.best_recompute_from_sums(local, compute, attn, c)
        if rc is None:
            continue
        typical = min(TYPICAL_DOC_LEN, max_seq_len)
        docs = np.full(max(1, int(local * c) // int(local_tokens(np.array([typical]), c)[0] * c)), typical)
        t_loc, t_comp, t_attn = (float(x.sum()) for x in cost.doc_terms(docs, c))
        rank_seconds = c * (cost.time_from_sums(local, compute, attn, c, 0, rc)
                            + cost.time_from_sums(t_loc, t_comp, t_attn, c, 0, rc))
        if best is None or rank_seconds < best[0]:
            best = (rank_seconds, StaticLayout(c, rc, int(local)))
    if best is None:
        raise ValueError(f"max_seq_len {max_seq_len} fits no static layout: no CP size dividing the domain "
                         f"({cost.cluster.domain_size}) up to {cost.cluster.cp_size_limit} holds it with the "
                         f"allowed recompute {list(cost.allowed_recompute)}; allow more recompute (e.g. full), "
                         f"a larger max CP size or more memory per rank")
    return best[1]


def pack_in_order(lengths: np.ndarray, layout: StaticLayout) -> list[tuple[int, int]]:
    """[start, end) index ranges of micro-batches: next-fit in batch order by padded tokens."""
    ends = np.cumsum(local_tokens(lengths, layout.cp_size))
    cap = layout.capacity_local_tokens
    ranges, start, used_before = [], 0, 0
    while start < lengths.size:
        # the most sequences from `start` whose tokens fit the capacity, at least one
        end = max(int(np.searchsorted(ends, used_before + cap, side="right")), start + 1)
        ranges.append((start, end))
        start, used_before = end, int(ends[end - 1])
    return ranges


def _microbatches(ids, lengths, cost, layout) -> list[tuple[tuple, float, float, float]]:
    """(sequences, local tokens, compute s, attention s) per micro-batch, in batch order."""
    local, compute, attn = cost.doc_terms(lengths, layout.cp_size)
    cl, cc, ca = (np.concatenate([[0.0], np.cumsum(x)]) for x in (local, compute, attn))
    seqs = list(zip(ids.tolist(), lengths.tolist()))
    return [(tuple(seqs[a:b]), cl[b] - cl[a], cc[b] - cc[a], ca[b] - ca[a])
            for a, b in pack_in_order(lengths, layout)]


def _build(cost, layout, per_replica: list[list[tuple]]) -> tuple[Wave, ...]:
    c = layout.cp_size
    replicas = len(per_replica)

    def mb(item, first_rank):
        seqs, loc, comp, att = item
        return microbatch_from_sums(cost, seqs, loc, comp, att, c, first_rank, layout.recompute)

    if not cost.model.lockstep:
        groups = tuple(Group(r * c, c, tuple(mb(it, r * c) for it in items)) for r, items in enumerate(per_replica))
        return (Wave(groups),)
    empty = ((), 0.0, 0.0, 0.0)
    count = max(len(items) for items in per_replica)
    return tuple(Wave(tuple(Group(r * c, c, (mb(per_replica[r][w] if w < len(per_replica[r]) else empty, r * c),))
                            for r in range(replicas)))
                 for w in range(count))


def static_packing(ids, lengths, cost, max_seq_len: int,
                   setting: StaticSetting | None = None) -> tuple[StaticLayout, list[tuple]]:
    """The run's static layout and this batch's micro-batches under it (shared by both policies)."""
    layout = static_layout(cost, max_seq_len, setting)
    return layout, _microbatches(ids, lengths, cost, layout)


def _cannot_beat(cost, layout, items, must_beat: float | None) -> bool:
    """True when even a perfect deal of these micro-batches is not faster than `must_beat`."""
    if must_beat is None:
        return False
    c = layout.cp_size
    times = [cost.time_from_sums(loc, comp, att, c, 0, layout.recompute) for _, loc, comp, att in items]
    replicas = cost.cluster.domain_size // c
    return max(max(times), sum(times) / replicas) >= must_beat * (1 + 1e-9)   # margin: rounding


def plan_static(ids, lengths, cost, *, max_seq_len: int, packing=None, setting: StaticSetting | None = None,
                must_beat: float | None = None) -> tuple[Wave, ...] | None:
    """The plan's waves; None when `must_beat` is given and the plan cannot be faster."""
    layout, items = packing or static_packing(ids, lengths, cost, max_seq_len, setting)
    if _cannot_beat(cost, layout, items, must_beat):
        return None
    replicas = cost.cluster.domain_size // layout.cp_size
    return _build(cost, layout, [items[r::replicas] for r in range(replicas)])


def plan_static_balanced(ids, lengths, cost, *, max_seq_len: int, packing=None, setting: StaticSetting | None = None,
                         must_beat: float | None = None) -> tuple[Wave, ...] | None:
    layout, items = packing or static_packing(ids, lengths, cost, max_seq_len, setting)
    if _cannot_beat(cost, layout, items, must_beat):
        return None
    c = layout.cp_size
    replicas = cost.cluster.domain_size // c
    times = [cost.time_from_sums(loc, comp, att, c, 0, layout.recompute) for _, loc, comp, att in items]
    order = sorted(range(len(items)), key=lambda i: (-times[i], i))
    per_count = math.ceil(len(items) / replicas)
    heap = [(0.0, r) for r in range(replicas)]
    per_replica: list[list[tuple]] = [[] for _ in range(replicas)]
    for i in order:
        load, r = heapq.heappop(heap)
        per_replica[r].append(items[i])
        if len(per_replica[r]) < per_count:
            heapq.heappush(heap, (load + times[i], r))
    return _build(cost, layout, per_replica)
