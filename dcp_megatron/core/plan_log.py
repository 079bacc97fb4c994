"""One-line summaries of a StepPlan for Megatron's log."""
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
