"""`megatron-dynamic`: Megatron-LM `dev`'s dynamic-CP scheduler (`--dynamic-context-parallel`,
`--sequence-packing-scheduler default_dynamic_cp`), re-implemented from its published algorithm
(megatron/core/datasets/data_schedule_utils.py, `next_hdp_group_packing_aware`, read 2026-12-02).

One call builds one micro-batch that spans the whole DP×CP domain (a wave here); the leftovers
start the next one, until every sequence is placed. Within a micro-batch:
- allowed CP sizes: powers of two that divide the domain D, and D itself (its pre-built
  communicators), from the smallest dynamic CP size up; a sequence's smallest size is the first
  whose padded per-rank share fits the per-rank token cap (Megatron's
  `--max-seqlen-per-dp-cp-rank`). Cap, smallest size and recompute are one run-wide
  `DynamicSetting` (baselines/settings.py): tuned over the run's batches by
  planner/baselines/sweep.py in the simulator, else `default_dynamic_setting`;
- sequences longest first; the first opens a group of its smallest size; each later one goes to
  the placement (join a group of size c whose packed tokens per rank still fit, or open a group
  of size c on free ranks, for every allowed c >= its smallest) that gives the lowest busiest-rank
  workload, workload = L²/c summed per rank; placements whose busiest rank would exceed
  1.05 · (longest length) · (token cap) are not taken and the sequence waits for the next
  micro-batch; ties keep the first found (smaller c, existing group before a new one);
- free ranks are then filled by growing the first group of the smallest size to the next allowed
  size; when that cannot fill the domain, the micro-batch is rebuilt as one group of all D ranks
  packed in order with what fits (the rest waits);
- no recompute choice: the setting's, run-wide (every micro-batch pays it; it must fit the cap).
Groups are laid out largest first from rank 0, so every group sits on an aligned block (the
position does not change a group's work). Every rank runs one micro-batch per wave (PP-friendly).
Not modelled: the VPP alignment split (`microbatch_group_size_per_vp_stage`). When the cluster caps CP below D (max_cp_size),
the full-domain fallback is not allowed and the unfilled ranks idle.
"""
from __future__ import annotations

import heapq
import itertools
import math
from typing import NamedTuple

import numpy as np

from dcp_megatron.planner.plan import NO_RECOMPUTE, Group, MicroBatch, StepPlan, Wave
from dcp_megatron.planner.baselines.dynamic_groups import SizeGroups
from dcp_megatron.planner.baselines.dynamic_stop import EndsTooLate
from dcp_megatron.planner.baselines.settings import DynamicSetting, check_recompute_fits, default_dynamic_setting
from dcp_megatron.planner.timeline import plan_makespan

WORKLOAD_SLACK = 0.05   # Megatron's allowance over the busiest-rank workload bound
FIRST_CHECK = 64        # sequences placed in a micro-batch before `EndsTooLate.unfinished` is first asked
CHECK_GROWTH = 0.5      # then again after half as many more placements: O(sequences) checking in all


def dynamic_cp_sizes(domain_size: int, limit: int, smallest: int = 1) -> list[int]:
    """Megatron dev's runtime CP sizes: powers of two dividing D, and D; here at most `limit` and at
    least `smallest` (its --min-dynamic-context-parallel-size)."""
    sizes, c = [], 1
    while c <= domain_size:
        if domain_size % c == 0:
            sizes.append(c)
        c *= 2
    if sizes[-1] != domain_size:
        sizes.append(domain_size)
    return [s for s in sizes if smallest <= s <= limit]


def plan_megatron_dynamic(ids, lengths, cost, *, max_seq_len: int, packing=None, must_beat: float | None = None,
                          setting: DynamicSetting | None = None) -> tuple[Wave, ...] | None:
    """The plan's waves; None when `must_beat` is given and the plan would not be faster
    (or this scheduler cannot hold the batch, so it is no contender; with `must_beat` the scheduler stops as soon as
    dynamic_stop.py proves that, the same answer sooner). `packing` (the static layout
    dcp's fallback shares) is not used: this scheduler has its own setting."""
    D = cost.cluster.domain_size
    setting = setting or cost.memoised(("dynamic_default", int(max_seq_len)), lambda: default_dynamic_setting(
        cost, max_seq_len, dynamic_cp_sizes(D, cost.cluster.cp_size_limit)))
    # the waves scheduled so far already end no sooner than must_beat: the plan cannot win, stop scheduling
    stop = None if must_beat is None else EndsTooLate(lengths, cost, setting.recompute, must_beat)
    try:
        waves_of_groups = dynamic_schedule(lengths, cost, setting, stop)
    except ValueError:
        if must_beat is not None:
            return None
        raise
    if waves_of_groups is None:
        return None
    waves = waves_of_schedule(waves_of_groups, ids, lengths, cost, setting.recompute)
    if must_beat is not None and plan_makespan(StepPlan(domain_size=D, waves=waves)) >= must_beat * (1 + 1e-9):
        return None
    return waves


def dynamic_schedule(lengths, cost, setting: DynamicSetting, stop=None) -> list[list[tuple[int, list[int]]]] | None:
    """`schedule_groups` under a setting (its recompute checked against the cap; ValueError when the
    setting cannot run: no allowed size, or a sequence that fits none); `stop` as there."""
    D = cost.cluster.domain_size
    check_recompute_fits(cost, setting.token_cap, setting.recompute, f"megatron-dynamic ({setting})")
    sizes = dynamic_cp_sizes(D, cost.cluster.cp_size_limit, setting.min_cp_size)
    if not sizes:
        raise ValueError(f"megatron-dynamic: no CP size from {setting.min_cp_size} up to "
                         f"{cost.cluster.cp_size_limit} on a domain of {D}")
    return schedule_groups(np.asarray(lengths), sizes, D, setting.token_cap, stop)


def schedule_groups(lengths, sizes: list[int], D: int, cap: int,
                    stop=None) -> list[list[tuple[int, list[int]]]] | None:
    """Per micro-batch, its groups as (CP size, sequence indices), largest size first; see the
    module docstring. Pure index arithmetic on lengths (a list or an array; testable by hand).
    `stop`, when given, may end the schedule early (None is returned then): `stop(groups)` is called with each
    micro-batch's groups once made, and `stop.unfinished(...)` (if it has one) a few times while one is being made
    (its groups so far, free ranks, the sizes, its sequences, their padded shares at the full-domain size when that
    size is allowed, the cap); either returning True stops."""
    arr = np.asarray(lengths, dtype=np.int64)
    share, fits = [], np.empty((len(sizes), arr.size), dtype=bool)
    for k, s in enumerate(sizes):
        row = 2 * -(-arr // (2 * s))                                  # padded tokens per rank at size s
        fits[k] = row <= cap
        share.append(row.tolist())
    if not fits[-1].all():
        j = int(np.flatnonzero(~fits[-1])[0])
        raise ValueError(f"megatron-dynamic: a sequence of {int(arr[j])} tokens fits no CP size up to {sizes[-1]} "
                         f"at {cap} tokens per rank")
    table = _Tables(sizes=sizes, share=share, smallest=fits.argmax(axis=0).tolist(),
                    square=(arr * arr).tolist(), length=arr.tolist())
    remaining = np.argsort(-arr, kind="stable").tolist()             # stable: ties keep batch order
    out = []
    while remaining:
        groups, remaining = _one_microbatch(remaining, table, D, cap, stop)
        if groups is None:
            return None
        groups.sort(key=lambda g: -g[0])                                  # stable: creation order within a size
        out.append(groups)
        if stop is not None and stop(groups):
            return None
    return out


class _Tables(NamedTuple):
    sizes: list[int]
    share: list[list[int]]      # [size index][sequence]
    smallest: list[int]         # index of each sequence's smallest size
    square: list[int]           # L² of each sequence
    length: list[int]


def _one_microbatch(order, t: _Tables, D: int, cap: int, stop=None):
    sizes, share, square = t.sizes, t.share, t.square
    tables = [SizeGroups() for _ in sizes]        # per size index: its groups (dynamic_groups.py)
    size, members = [], []                            # per group id (creation order): size index, sequences

    def open_group(k: int) -> int:
        size.append(k), members.append([])
        return tables[k].add(len(size) - 1)

    first = order[0]
    k0 = t.smallest[first]
    bound = t.length[first] * cap * (1 + WORKLOAD_SLACK)
    members[tables[k0].ids[open_group(k0)]].append(first)
    tables[k0].join(0, share[k0][first], square[first] / sizes[k0])
    used, busiest = sizes[k0], square[first] / sizes[k0]
    leftovers = []

    def placeable(i: int) -> bool:
        """Whether any placement of sequence i fits; with the state fixed this only turns from
        False to True along `order` (shorter sequences fit wherever longer ones do)."""
        for k in range(t.smallest[i], len(sizes)):
            s = sizes[k]
            w = square[i] / s
            if (D - used >= s and w <= bound) or tables[k].first_within(cap - share[k][i], w, bound) >= 0:
                return True
        return False

    p, n = 1, len(order)
    next_check = FIRST_CHECK if stop is not None and getattr(stop, "unfinished", None) else n + 1
    while p < n:
        i = order[p]
        p += 1
        best = None                                   # (busiest after, local group index or None, size index)
        for k in range(t.smallest[i], len(sizes)):
            s, room = sizes[k], cap - share[k][i]
            w = square[i] / s
            if busiest <= bound:                      # the first group the busiest rank stays the same in
                j = tables[k].first_within(room, w, busiest)
                if j >= 0:
                    best = (busiest, j, k)
                    break
            opens = D - used >= s
            if opens and w <= busiest <= bound:       # a new group keeps the busiest: no group here does
                best = (busiest, None, k)
                break
            least = tables[k].least_after(room, w, bound)
            if least is not None and (best is None or least[0] < best[0]):
                best = (least[0], least[1], k)
            if opens:
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
        busiest, j, k = best
        if j is None:
            j, used = open_group(k), used + sizes[k]
        members[tables[k].ids[j]].append(i)
        tables[k].join(j, share[k][i], square[i] / sizes[k])
        if p >= next_check:                       # a few checks a wave: O(sequences) in all
            if stop.unfinished([(sizes[k], m) for k, m in zip(size, members)], D - used, sizes, order,
                               share[-1] if sizes[-1] == D else None, cap):
                return None, None
            next_check = p + max(FIRST_CHECK, int(p * CHECK_GROWTH))
    size = [sizes[k] for k in size]
    by_size = [(s, g) for g, s in enumerate(size)]    # the first smallest group is the heap's least
    heapq.heapify(by_size)
    while used < D:                                   # grow the first smallest group to the next size
        smallest, g = by_size[0]
        bigger = [s for s in sizes if s > smallest]
        if not bigger or used + bigger[0] - smallest > D:
            break
        size[g], used = bigger[0], used + bigger[0] - smallest
        heapq.heapreplace(by_size, (bigger[0], g))
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


class ScheduleSums(NamedTuple):
    """A schedule's groups in wave order as arrays (what does not depend on the recompute)."""
    local: np.ndarray           # summed local tokens per rank
    compute: np.ndarray         # summed compute seconds
    attn: np.ndarray            # summed attention seconds
    size: np.ndarray            # CP size
    first: np.ndarray           # first rank (groups laid out from rank 0 in order)
    wave: np.ndarray            # wave index


def schedule_sums(waves_of_groups, lengths, cost) -> ScheduleSums:
    """Every group's summed terms, elementwise per CP size used, so a group's slice sums to the same floats."""
    terms = {s: cost.doc_terms(lengths, s) for s in {s for groups in waves_of_groups for s, _ in groups}}
    sums = [tuple(float(x[members].sum()) for x in terms[s]) for groups in waves_of_groups for s, members in groups]
    flat = [(s, first) for groups in waves_of_groups for s, first in zip(*_firsts(groups))]
    loc, comp, attn = (np.array([t[n] for t in sums], dtype=np.float64) for n in range(3))
    wave = np.repeat(np.arange(len(waves_of_groups)), [len(groups) for groups in waves_of_groups])
    return ScheduleSums(loc, comp, attn, np.array([s for s, _ in flat], dtype=np.int64),
                        np.array([f for _, f in flat], dtype=np.int64), wave.astype(np.int64))


def waves_of_schedule(waves_of_groups, ids, lengths, cost, recompute, sums: ScheduleSums | None = None
                      ) -> tuple[Wave, ...]:
    """The waves of a schedule with one run-wide recompute (the schedule does not depend on it; `sums`: its
    `schedule_sums` when already known)."""
    D = cost.cluster.domain_size
    seqs = list(zip(ids.tolist(), lengths.tolist()))
    sums = schedule_sums(waves_of_groups, lengths, cost) if sums is None else sums
    # every group's estimates at once (`times_from_sums`: the same floats as one micro-batch at a time)
    times = cost.times_from_sums(sums.local, sums.compute, sums.attn, sums.size, sums.first, recompute).tolist()
    per_token = {s: cost.bytes_per_local_token(recompute, s) for s in set(sums.size.tolist())}
    mems = [cost.static_bytes + int(math.ceil(x * per_token[s])) for x, s in zip(sums.local.tolist(),
                                                                                 sums.size.tolist())]
    waves, n = [], 0
    for groups in waves_of_groups:
        out = []
        for (s, members), first in zip(groups, _firsts(groups)[1]):
            out.append(Group(first, s, (MicroBatch(tuple(seqs[j] for j in members), recompute, times[n], mems[n]),)))
            n += 1
        out.extend(_idle(rank, cost, recompute) for rank in range(sum(s for s, _ in groups), D))
        waves.append(Wave(tuple(out)))
    return tuple(waves)


def _firsts(groups) -> tuple[list[int], list[int]]:
    """(sizes, first ranks) of a wave's groups laid out from rank 0 in order."""
    sizes = [s for s, _ in groups]
    return sizes, [0] + list(itertools.accumulate(sizes))[:-1]


def _idle(rank: int, cost, recompute) -> Group:
    """A rank no group uses: nothing to run, or in lockstep an empty micro-batch (under ZeRO-3 with the run-wide
    recompute: it joins the wave's weight gathers)."""
    if not cost.model.lockstep:
        return Group(rank, 1, ())
    filler = recompute if cost.model.wave_uniform_relief else NO_RECOMPUTE
    return Group(rank, 1, (MicroBatch((), filler, est_time_s=cost.cluster.microbatch_overhead_s,
                                      est_mem_bytes=cost.static_bytes),))
