"""The DCP step scalars (`runtime/step_scalars.py`) through Megatron's own writers.

`get_tensorboard_writer()` / `get_wandb_writer()` exist on the last rank when the run has
`--tensorboard-dir` / `--wandb-project`: the writers Megatron's `training_log` uses, so the
`dcp/*` tags land in the same event files and W&B run as Megatron's own, every training step.
"""
from __future__ import annotations

from dcp_megatron.planner.plan import StepPlan
from dcp_megatron.planner.rescore import rescored
from dcp_megatron.runtime.step_scalars import step_scalars


def megatron_writers_present() -> bool:
    """Whether this rank holds Megatron's TensorBoard or W&B writer."""
    from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

    return get_tensorboard_writer() is not None or get_wandb_writer() is not None


def write_step(plan: StepPlan, *, iteration: int, measured_s: float, planning_s: float, exposed_planning_s: float,
               base_cost, refining: bool, pad_multiple: int = 1, memory_scale=None, memory_margin: float = 0.0) -> None:
    """One training step's scalars. `base_cost` is the cost model as configured: with online
    refinement on, the plan (scored by the refined model) is also scored by it."""
    unrefined_s = rescored(plan, base_cost).est_step_time_s if refining else plan.est_step_time_s
    scalars = step_scalars(plan, measured_s=measured_s, planning_s=planning_s, exposed_planning_s=exposed_planning_s,
                           predicted_unrefined_s=unrefined_s, pad_multiple=pad_multiple, memory_scale=memory_scale,
                           memory_margin=memory_margin)
    write_to_megatron_writers(scalars, iteration)


def write_to_megatron_writers(scalars: dict[str, float], iteration: int) -> bool:
    """Through Megatron's TensorBoard and W&B writers; returns whether any writer took them."""
    from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

    written = False
    writer = get_tensorboard_writer()
    if writer is not None:
        for tag, value in scalars.items():
            writer.add_scalar(tag, value, iteration)
        written = True
    wandb = get_wandb_writer()
    if wandb is not None:
        wandb.log(scalars, iteration)
        written = True
    return written
