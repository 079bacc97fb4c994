"""The DCP step scalars (`runtime/step_scalars.py`) through a DeepSpeed engine's monitor.

DeepSpeed's `MonitorMaster` (`engine.monitor`) writes to the TensorBoard, W&B, Comet and CSV
back-ends its config enables (`"tensorboard": {"enabled": true, "output_path": ...}`), on global
rank 0, so the `dcp/*` tags land beside DeepSpeed's own `Train/Samples/*` events.
"""
from __future__ import annotations

from dcp_megatron.planner.plan import StepPlan
from dcp_megatron.planner.rescore import rescored
from dcp_megatron.runtime.step_scalars import step_scalars


def write_step_to_monitor(monitor, plan: StepPlan, *, step: int, measured_s: float, planned, base_cost,
                          refining: bool, memory_scale=None, memory_margin: float = 0.0) -> bool:
    """One step's scalars; False (nothing computed) when the engine has no monitor enabled.
    `planned` is the step's PlannedStep (planning and exposed planning time)."""
    if monitor is None or not getattr(monitor, "enabled", False):
        return False
    unrefined_s = rescored(plan, base_cost).est_step_time_s if refining else plan.est_step_time_s
    scalars = step_scalars(plan, measured_s=measured_s, planning_s=planned.plan_s,
                           exposed_planning_s=planned.exposed_s, predicted_unrefined_s=unrefined_s,
                           memory_scale=memory_scale, memory_margin=memory_margin)
    monitor.write_events([(tag, value, step) for tag, value in scalars.items()])
    return True
