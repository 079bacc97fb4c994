"""dcp's per-micro-batch relief over a given layout: each micro-batch gets the cheapest relief that fits.

The baselines pay one run-wide relief on every micro-batch (a run cannot change it per step). dcp seeds its
search with a baseline's layout (groups, packing, order) where that layout beats dcp's own, and re-chooses
every micro-batch's relief from the menu (`CostModel.choose_recompute`): never slower, since the run-wide
relief that fits is on the menu too. The result is dcp's plan when it differs from the baseline's; an
unchanged layout stays the baseline's plan (`extra["fallback"]`), so a copy is never relabelled as our own.
"""
from __future__ import annotations

from dcp_megatron.planner.plan import Group, Wave
from dcp_megatron.planner.policies.common import microbatch_from_sums


def with_own_reliefs(waves: tuple[Wave, ...], cost) -> tuple[tuple[Wave, ...], bool]:
    """(the waves with each micro-batch's relief re-chosen, whether any relief changed)."""
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
