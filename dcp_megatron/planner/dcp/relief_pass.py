"""dcp's per-micro-batch relief over a given layout: each micro-batch gets the cheapest relief that fits.

The baselines pay one run-wide relief on every micro-batch (a run cannot change it per step). dcp seeds its
search with a baseline's layout (groups, packing, order) where that layout beats dcp's own, and re-chooses
every micro-batch's relief from the menu (`CostModel.choose_recompute`): never slower, since the run-wide
relief that fits is on the menu too. The result is dcp's plan when it differs from the baseline's; an
unchanged layout stays the baseline's plan (`extra["fallback"]`), so a copy is never relabelled as our own.

Under ZeRO-3 (`ModelShape.wave_uniform_relief`) every micro-batch of a wave, idle fillers included, runs one
relief (`wave_relief`: of those that hold the wave's fullest micro-batch, the one whose slowest micro-batch ends
soonest); a baseline's wave keeps its run-wide relief unless one makes no micro-batch of it slower.
"""
from __future__ import annotations

import numpy as np

from dcp_megatron.planner.plan import NO_RECOMPUTE, Group, MicroBatch, Recompute, Wave
from dcp_megatron.planner.layout import microbatch_from_sums


def with_own_reliefs(waves: tuple[Wave, ...], cost) -> tuple[tuple[Wave, ...], bool]:
    """(the waves with each micro-batch's relief re-chosen, per wave under ZeRO-3; whether any relief changed)."""
    if cost.model.wave_uniform_relief:
        return with_wave_reliefs(waves, cost)
    changed, out = False, []
    for wave in waves:
        groups = []
        for g in wave.groups:
            mbs = []
            for mb in g.microbatches:
                if not mb.sequences:
                    mbs.append(mb)
                    continue
                local, compute, attn = cost._sums(mb.lengths, g.size)
                new = microbatch_from_sums(cost, mb.sequences, local, compute, attn, g.size, g.first_rank)
                if new.recompute != mb.recompute and new.est_time_s < mb.est_time_s:
                    mbs.append(new)
                    changed = True
                else:
                    mbs.append(mb)
            groups.append(Group(g.first_rank, g.size, tuple(mbs)))
        out.append(Wave(tuple(groups)))
    return tuple(out), changed


def wave_relief(cost, local, compute, attn, sizes, firsts, no_slower_than=None) -> tuple[Recompute | None, np.ndarray]:
    """(relief, seconds of each micro-batch with it) for the micro-batches of one wave, given as arrays of their
    sums: of the reliefs that hold the fullest one (`CostModel.fitting_reliefs`), the one whose slowest
    micro-batch ends soonest (then the least total); `no_slower_than`: only reliefs that keep every micro-batch
    within these seconds. (None, inf) when none qualifies; (none, overhead) for a wave of idle fillers only."""
    local = np.asarray(local, dtype=np.float64)
    if not local.size or local.max() <= 0:
        return NO_RECOMPUTE, np.full(local.shape, cost.cluster.microbatch_overhead_s)
    options = cost.fitting_reliefs(float(local.max()))
    if options and options[0] is NO_RECOMPUTE and not cost.time_scale and no_slower_than is None:
        options = options[:1]                 # none holds them all: the fastest
    best, best_key, best_times = None, None, np.full(local.shape, np.inf)
    for relief in options:
        times = cost.times_from_sums(local, np.asarray(compute, dtype=np.float64), np.asarray(attn, dtype=np.float64),
                                     np.asarray(sizes), np.asarray(firsts), relief)
        if no_slower_than is not None and (times > np.asarray(no_slower_than) * (1 + 1e-12)).any():
            continue
        key = (float(times.max()), float(times.sum()))
        if best_key is None or key < best_key:
            best, best_key, best_times = relief, key, times
    return best, best_times


def with_wave_reliefs(waves: tuple[Wave, ...], cost, *, no_slower: bool = True) -> tuple[tuple[Wave, ...], bool]:
    """(the waves with one relief per wave, fillers included (`wave_relief`; `no_slower`: only one that makes no
    micro-batch slower than it was, else the wave stays), whether any relief changed)."""
    changed, out = False, []
    for wave in waves:
        where, sums = [], []
        for gi, g in enumerate(wave.groups):
            for mi, mb in enumerate(g.microbatches):
                if mb.sequences:
                    where.append((gi, mi))
                    sums.append((*cost._sums(mb.lengths, g.size), g.size, g.first_rank, mb.est_time_s))
        if not sums:
            out.append(wave)
            continue
        local, compute, attn, sizes, firsts, now = (np.array(col) for col in zip(*sums))
        relief, _ = wave_relief(cost, local, compute, attn, sizes.astype(np.int64), firsts.astype(np.int64),
                                now if no_slower else None)
        if relief is None:     # nothing makes no micro-batch slower: keep theirs, if they share one
            theirs = {wave.groups[gi].microbatches[mi].recompute for gi, mi in where}
            relief = theirs.pop() if len(theirs) == 1 else None
        if relief is None or {mb.recompute for g in wave.groups for mb in g.microbatches} == {relief}:
            out.append(wave)
            continue
        # a filler taking its wave's relief is no change of the layout's (it runs nothing)
        changed = changed or any(g.microbatches[mi].recompute != relief for gi, mi in where
                                 for g in (wave.groups[gi],))
        mine = dict(zip(where, sums))
        groups = []
        for gi, g in enumerate(wave.groups):
            mbs = []
            for mi, mb in enumerate(g.microbatches):
                if (gi, mi) in mine:
                    loc, comp, att = mine[gi, mi][:3]
                    mbs.append(microbatch_from_sums(cost, mb.sequences, loc, comp, att, g.size, g.first_rank, relief))
                else:
                    mbs.append(MicroBatch((), relief, mb.est_time_s, mb.est_mem_bytes))
            groups.append(Group(g.first_rank, g.size, tuple(mbs)))
        out.append(Wave(tuple(groups)))
    return tuple(out), changed
