"""--dcp-dump-plans DIR: each step's plan as JSON (StepPlan.dumps) and as a per-rank timeline PNG."""
from __future__ import annotations

import os

from dcp_megatron.planner.plan import StepPlan


class PlanDumper:
    def __init__(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        self.directory = directory

    def write(self, iteration: int, plan: StepPlan) -> tuple[str, str]:
        from dcp_megatron.plotting import draw_step_timelines

        stem = os.path.join(self.directory, f"step_{iteration:07d}")
        with open(stem + ".json", "w") as f:
            f.write(plan.dumps() + "\n")
        draw_step_timelines({plan.policy or "plan": plan}, stem + ".png", title=f"iteration {iteration}")
        return stem + ".json", stem + ".png"
