"""One-line summaries of a StepPlan and the `dcp iteration` line both engines log."""
from __future__ import annotations

from dcp_megatron.planner.plan import StepPlan
from dcp_megatron.planner.plan_origin import plan_label


def plan_summary(plan: StepPlan) -> str:
    """policy (and the baseline layout it fell back to or was seeded from: plan_origin.py), waves, CP-size histogram (sequences per CP size), micro-batches per rank, recompute."""
    hist = ",".join(f"cp{c}x{n}" for c, n in plan.cp_size_histogram().items()) or "-"
    counts = [plan.num_microbatches(r) for r in range(plan.domain_size)]
    recomputed: dict[str, int] = {}
    for wave in plan.waves:
        for group in wave.groups:
            for mb in group.microbatches:
                if mb.sequences and mb.recompute.kind != "none":
                    recomputed[str(mb.recompute)] = recomputed.get(str(mb.recompute), 0) + 1
    recompute = ",".join(f"{k}x{v}" for k, v in sorted(recomputed.items())) or "none"
    # A plan on a baseline's layout says so (its policy stays "dcp": the dcp policy chose it).
    return (f"plan {plan_label(plan)}: waves {len(plan.waves)} | cp sizes {hist} | "
            f"micro-batches/rank {'/'.join(map(str, counts))} (min {min(counts)}, max {max(counts)}) | "
            f"recompute {recompute}")


def dcp_iteration_line(record, *, forward_backward_s: float, domain_rank: int, corrections: dict,
                       memory: str = "") -> str:
    """The ` dcp iteration` log line both engines print for a step (`record`: the loop's StepRecord): its plan,
    the predicted and measured time (`forward_backward_s`: the engine's own measure of the step), planning time,
    the step-time error, the cost model's measured corrections, the memory count's (`memory`:
    memory_correction.describe_scale) and what this rank ran."""
    plan, planned, errors = record.plan, record.planned, record.step_time_errors
    return (f" dcp iteration {record.iteration:8d} | {plan_summary(plan)} | predicted (ms): "
            f"{plan.est_step_time_s * 1000:.1f} | forward-backward (ms): {forward_backward_s * 1000:.1f} "
            f"(before the schedule {record.before_run_s * 1000:.1f}) | planning (ms): {planned.plan_s * 1000:.1f} "
            f"{'ahead' if planned.ahead else 'at step start'}, exposed {planned.exposed_s * 1000:.1f} | "
            f"step-time error {errors[-1]:.0%} (last {len(errors)}: mean "
            f"{sum(errors) / len(errors):.0%}){_factors_text(corrections)} | "
            f"{memory + ' | ' if memory else ''}rank {domain_rank} "
            f"ran {record.num_batches} micro-batches, cp sizes {list(record.cp_sizes)} |")


def _factors_text(factors: dict) -> str:
    if not factors:
        return ""
    shown = ", ".join(f"cp{cp}/{kind} x{factor:.2f}" for (cp, kind), factor in sorted(factors.items()))
    return f", measured corrections {shown}"
