"""`dcp` with pipeline parallelism: every group runs exactly one micro-batch per wave.

Two plans are built and the one with the shorter timeline is returned: mixed-size waves
(waves.py, usually the better one) and uniform waves, described here.
1F1B needs every rank to run the same micro-batch count; in uniform waves a wave of CP size
c tiles the domain with D/c groups (c divides D), each running one micro-batch. Per size class:
- sequences choose sizes as in the PP = 1 policy, among sizes dividing D;
- a class with fewer sequences than it has groups per wave moves up to the next size (a
  sequence that fits at c fits at any larger size), so no group idles with an empty
  micro-batch unless even the largest size has more groups than sequences;
- k waves hold k·D/c equal-work bins (longest first to the least-worked bin with room;
  the per-rank token room is what fits with full recompute; k is the fewest that hold the
  class's tokens without recompute); each bin gets the fastest recompute that fits;
- a class whose bins would not fit that many waves moves up a size too (fewer, larger groups);
  at the largest size the last wave may hold empty micro-batches (a group with nothing to run
  still takes part in the pipeline schedule);
- bins sorted by time fill the waves, so each wave's groups take about equally long.
"""
from __future__ import annotations

import math

import numpy as np

from dcp_megatron.planner.plan import Group, MicroBatch, StepPlan, Wave
from dcp_megatron.planner.layout import candidate_sizes, divisor_sizes, microbatch_from_sums, min_fitting_size
from dcp_megatron.planner.list_scheduling import lpt_bins
from dcp_megatron.planner.dcp.sized_sequences import SizedSequences
from dcp_megatron.planner.dcp.waves import plan_mixed_waves
from dcp_megatron.planner.dcp.relief_pass import with_wave_reliefs
from dcp_megatron.planner.timeline import plan_makespan


def plan_dcp_pipeline(ids: np.ndarray, lengths: np.ndarray, cost) -> tuple[Wave, ...]:
    D = cost.cluster.domain_size
    sizes = candidate_sizes(cost.cluster)
    seqs = SizedSequences(lengths, sizes, min_fitting_size(lengths, ids, sizes, cost), cost)
    seqs.grow_long_sequences(D, len(sizes) - 1)
    mixed = plan_mixed_waves(ids, lengths, cost, seqs)
    uniform = _uniform_waves(ids, lengths, cost)
    if mixed is None:
        return uniform
    timeline = [plan_makespan(StepPlan(domain_size=D, waves=w)) for w in (mixed, uniform)]
    return mixed if timeline[0] <= timeline[1] else uniform


def _uniform_waves(ids: np.ndarray, lengths: np.ndarray, cost) -> tuple[Wave, ...]:
    D = cost.cluster.domain_size
    sizes = divisor_sizes(cost.cluster)
    seqs = SizedSequences(lengths, sizes, min_fitting_size(lengths, ids, sizes, cost), cost)
    seqs.grow_long_sequences(D, len(sizes) - 1)
    for k in range(len(sizes) - 1):
        members = np.flatnonzero(seqs.idx == k)
        if 0 < members.size < D // sizes[k]:
            seqs.move(members, np.full(members.size, k + 1))
    cap_none = cost.max_local_tokens(cost.base_recompute)
    cap_full = cost.max_local_tokens(cost.strongest_recompute)
    pairs = list(zip(ids.tolist(), lengths.tolist()))
    classes: dict[int, tuple[np.ndarray, list[list[int]], int]] = {}
    for k in range(len(sizes)):
        members = np.flatnonzero(seqs.idx == k)
        if not members.size:
            continue
        members = members[np.lexsort((ids[members], -seqs.seconds[members]))]
        groups_per_wave = D // sizes[k]
        local = seqs.local[members]
        tokens = np.ceil(local).astype(np.int64).tolist()
        work = seqs.seconds[members].tolist()
        top = k == len(sizes) - 1
        most_waves = max(1, members.size // groups_per_wave)
        if top:                   # nowhere to move up to: allow groups with an empty micro-batch
            most_waves = max(1, -(-members.size // groups_per_wave))
        num_waves = min(most_waves, max(1, math.ceil(float(local.sum()) / (groups_per_wave * cap_none))))
        while True:
            bins = lpt_bins(range(members.size), work, tokens, cap_full, num_waves * groups_per_wave)
            if len(bins) <= num_waves * groups_per_wave or num_waves >= most_waves:
                break
            num_waves += 1
        if len(bins) > num_waves * groups_per_wave:
            assert not top, "one sequence per bin always fits at the largest size"
            seqs.move(members, np.full(members.size, k + 1))   # fits in fewer, larger groups
            continue
        classes[k] = (members, bins, num_waves)
    waves: list[Wave] = []
    for k in sorted(classes, reverse=True):
        members, bins, num_waves = classes[k]
        size, groups_per_wave = sizes[k], D // sizes[k]
        mbs = []
        for b in bins:
            chosen = members[b]
            mbs.append((tuple(pairs[i] for i in chosen.tolist()), float(seqs.local[chosen].sum()),
                        float(seqs.compute[chosen].sum()), float(seqs.attn[chosen].sum())))
        mbs.sort(key=lambda m: -cost.time_from_sums(m[1], m[2], m[3], size, 0, cost.base_recompute))
        mbs += [((), 0.0, 0.0, 0.0)] * (num_waves * groups_per_wave - len(mbs))
        for w in range(num_waves):
            groups = []
            for g in range(groups_per_wave):
                seqs_, loc, comp, att = mbs[w * groups_per_wave + g]
                first = g * size
                mb = (microbatch_from_sums(cost, seqs_, loc, comp, att, size, first) if seqs_ else
                      MicroBatch((), est_time_s=cost.cluster.microbatch_overhead_s, est_mem_bytes=cost.static_bytes))
                groups.append(Group(first, size, (mb,)))
            waves.append(Wave(tuple(groups)))
    if cost.model.wave_uniform_relief:      # ZeRO-3: one relief per wave, fillers included
        return with_wave_reliefs(tuple(waves), cost, no_slower=False)[0]
    return tuple(waves)
