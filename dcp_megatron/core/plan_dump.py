"""--dcp-dump-plans DIR: each step's plan as JSON (StepPlan.dumps), one file per iteration.

Only JSON is written during training (it is cheap); `tools/draw_plan.py DIR/step_*.json` draws them
as per-rank timelines afterwards, off the training path.
"""
from __future__ import annotations

import os

from dcp_megatron.planner.plan import StepPlan


class PlanDumper:
    def __init__(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        self.directory = directory

    def write(self, iteration: int, plan: StepPlan) -> str:
        path = os.path.join(self.directory, f"step_{iteration:07d}.json")
        with open(path, "w") as f:
            f.write(plan.dumps() + "\n")
        return path
