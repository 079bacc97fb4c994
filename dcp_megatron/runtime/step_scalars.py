"""A DCP step's facts as named scalars, for the engines' own writers.

The Megatron path writes them through Megatron's TensorBoard / W&B writers
(`training/scalar_writers.py`), the DeepSpeed path through the engine's monitor
(`deepspeed/scalar_writers.py`). Every tag starts with `dcp/`. Plan facts are the same on every
rank; measured times are the writing rank's own.

| tag | what |
|---|---|
| dcp/cp_size_min, dcp/cp_size_max | smallest and largest CP group that ran a document |
| dcp/sequences_cp{c} | documents that ran on CP groups of size c |
| dcp/microbatches_per_rank_min, _max | micro-batches per domain rank |
| dcp/recompute_share | share of non-empty micro-batches that recompute (any policy but none) |
| dcp/predicted_step_s | the plan's step time (the cost model in use: refined when refinement is on) |
| dcp/predicted_unrefined_s | the same plan scored by the cost model as configured (refinement off) |
| dcp/measured_step_s | this rank's forward-backward wall time, planning and exchange included |
| dcp/prediction_error | abs(predicted - measured) / measured |
| dcp/planning_s, dcp/exposed_planning_s | planning time, and the part the step waited for |
| dcp/lower_bound_ratio | predicted step time / the batch's lower bound |
| dcp/tokens, dcp/tokens_padded | the step's document tokens, and pad tokens added for CP (2c) / SP splits |
| dcp/fallback | 1 when dcp chose a baseline's plan as is |
| dcp/memory_scale_max, dcp/memory_scale_{relief} | the memory count's largest factor, and each measured relief's |
| dcp/memory_margin | the headroom the memory correction keeps above measured bytes (0.05: 5%) |
| dcp/seeded | 1 when dcp chose a baseline's layout with its own reliefs (`extra.seeded_from`); both 0: dcp's own layout |
"""
from __future__ import annotations

from dcp_megatron.planner.plan import StepPlan
from dcp_megatron.planner.plan_origin import FALLBACK, SEEDED, plan_origin
from dcp_megatron.planner.padding import padded_length

TAG_PREFIX = "dcp/"


def plan_scalars(plan: StepPlan, *, pad_multiple: int = 1) -> dict[str, float]:
    """The plan's own facts (no measurement): identical on every rank."""
    counts = [plan.num_microbatches(rank) for rank in range(plan.domain_size)]
    origin, _ = plan_origin(plan)
    per_size: dict[int, int] = {}
    tokens = padded = run = recomputing = 0
    for wave in plan.waves:
        for group in wave.groups:
            for mb in group.microbatches:
                if not mb.sequences:
                    continue
                run += 1
                recomputing += mb.recompute.kind != "none"
                for _, length in mb.sequences:
                    per_size[group.size] = per_size.get(group.size, 0) + 1
                    tokens += length
                    padded += padded_length(length, group.size, pad_multiple) - length
    out = {"cp_size_min": min(per_size, default=0), "cp_size_max": max(per_size, default=0),
           "microbatches_per_rank_min": min(counts), "microbatches_per_rank_max": max(counts),
           "recompute_share": recomputing / run if run else 0.0,
           "predicted_step_s": plan.est_step_time_s,
           "lower_bound_ratio": plan.est_step_time_s / plan.lower_bound_s if plan.lower_bound_s > 0 else 0.0,
           "tokens": tokens, "tokens_padded": padded,
           "fallback": float(origin == FALLBACK), "seeded": float(origin == SEEDED)}
    out.update({f"sequences_cp{size}": n for size, n in sorted(per_size.items())})
    return {TAG_PREFIX + k: float(v) for k, v in out.items()}


def step_scalars(plan: StepPlan, *, measured_s: float, planning_s: float, exposed_planning_s: float,
                 predicted_unrefined_s: float, pad_multiple: int = 1, memory_scale=None,
                 memory_margin: float = 0.0) -> dict[str, float]:
    """`plan_scalars` plus the step's measured and planning times, and the memory count's factors
    (`memory_scale`: planner/costmodel/memory_correction.MemoryScale, when the engine corrects it)."""
    out = plan_scalars(plan, pad_multiple=pad_multiple)
    out.update({TAG_PREFIX + "predicted_unrefined_s": float(predicted_unrefined_s),
                TAG_PREFIX + "measured_step_s": float(measured_s),
                TAG_PREFIX + "prediction_error": abs(plan.est_step_time_s - measured_s) / measured_s
                if measured_s > 0 else 0.0,
                TAG_PREFIX + "planning_s": float(planning_s),
                TAG_PREFIX + "exposed_planning_s": float(exposed_planning_s)})
    if memory_scale is not None:
        out[TAG_PREFIX + "memory_scale_max"] = float(max([memory_scale.default, *memory_scale.factors.values()]))
        out[TAG_PREFIX + "memory_margin"] = float(memory_margin)
        out.update({f"{TAG_PREFIX}memory_scale_{relief}": float(v)
                    for relief, v in sorted(memory_scale.factors.items())})
    return out
