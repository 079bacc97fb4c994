"""A plan scored by another cost model: the same layout, every estimate recomputed.

The simulator scores every policy's plan itself (no policy grades its own homework); a training
run with online refinement scores its plan by the cost model as configured too, to show the
prediction with refinement off beside the refined one.
"""
from __future__ import annotations

import dataclasses

from dcp_megatron.planner.plan import StepPlan
from dcp_megatron.planner.timeline import plan_makespan


def rescored(plan: StepPlan, cost) -> StepPlan:
    """The plan with every micro-batch's time and memory re-estimated by `cost`, and its step
    time the resulting per-rank timeline's makespan."""
    waves = []
    for wave in plan.waves:
        groups = []
        for group in wave.groups:
            mbs = tuple(dataclasses.replace(
                mb, est_time_s=cost.microbatch_time(mb.lengths, group.size, first_rank=group.first_rank,
                                                    recompute=mb.recompute),
                est_mem_bytes=cost.microbatch_memory(mb.lengths, group.size, recompute=mb.recompute))
                for mb in group.microbatches)
            groups.append(dataclasses.replace(group, microbatches=mbs))
        waves.append(dataclasses.replace(wave, groups=tuple(groups)))
    plan = dataclasses.replace(plan, waves=tuple(waves))
    return dataclasses.replace(plan, est_step_time_s=plan_makespan(plan))
