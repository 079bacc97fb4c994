"""Draw plans as per-rank timelines: ranks on y, time on x, one box per micro-batch.

A group's micro-batch is one box spanning the group's ranks (all members run it in
lock-step), coloured by the group's CP size with the same colours in every panel. The times
come from `planner.timeline.rank_timeline` (a group starts a wave when all its members have
finished the previous one). One panel per plan, sharing the time axis, so policies compare
at a glance; a dashed line marks the plan's lower bound when it has one.

matplotlib is imported lazily (Agg backend) so the planner and simulator never need it
unless a picture is asked for.
"""
from __future__ import annotations

from typing import Mapping

from dcp_megatron.planner.plan import StepPlan
from dcp_megatron.planner.timeline import plan_makespan, rank_timeline


def _seconds(t: float) -> str:
    return f"{t:.2f} s" if t >= 1.0 else f"{t * 1e3:.1f} ms"


def _cp_colours(sizes: list[int]) -> dict[int, tuple]:
    import matplotlib

    palette = matplotlib.colormaps["tab10"]
    return {size: palette(i % 10) for i, size in enumerate(sorted(sizes))}


def _group_boxes(plan: StepPlan) -> list[tuple[float, float, int, int]]:
    """(start_s, end_s, first_rank, size) of every micro-batch of every group."""
    boxes = []
    for rank, slots in enumerate(rank_timeline(plan)):
        for slot in slots:
            if slot.group_first_rank == rank:      # draw each group once, from its first rank
                boxes.append((slot.start_s, slot.end_s, slot.group_first_rank, slot.group_size))
    return boxes


def draw_step_timelines(plans: Mapping[str, StepPlan], out_path: str, *, title: str = "") -> None:
    """Write a PNG with one timeline panel per plan (label -> plan)."""
    if not plans:
        raise ValueError("draw_step_timelines needs at least one plan")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Patch, Rectangle

    boxes = {label: _group_boxes(plan) for label, plan in plans.items()}
    colours = _cp_colours(sorted({b[3] for bs in boxes.values() for b in bs}))
    max_domain = max(plan.domain_size for plan in plans.values())
    panel_height = min(6.0, 1.2 + 0.08 * max_domain)
    fig, axes = plt.subplots(len(plans), 1, figsize=(12, panel_height * len(plans)), sharex=True, squeeze=False)
    for ax, (label, plan) in zip(axes[:, 0], plans.items()):
        rects = [Rectangle((start, first), end - start, size) for start, end, first, size in boxes[label]]
        faces = [colours[size] for _, _, _, size in boxes[label]]
        ax.add_collection(PatchCollection(rects, facecolors=faces, edgecolors="black", linewidths=0.3))
        makespan = plan_makespan(plan)
        if plan.lower_bound_s > 0:
            ax.axvline(plan.lower_bound_s, color="black", linestyle="--", linewidth=0.8)
        ax.set_ylim(plan.domain_size, 0)        # rank 0 on top
        step = max(1, plan.domain_size // 16)
        ax.set_yticks([r + 0.5 for r in range(0, plan.domain_size, step)],
                      [str(r) for r in range(0, plan.domain_size, step)])   # rank r is the row [r, r+1)
        ax.set_ylabel("rank")
        bound = f", lower bound {_seconds(plan.lower_bound_s)}" if plan.lower_bound_s > 0 else ""
        ax.set_title(f"{label}: step {_seconds(makespan)}{bound}", fontsize=10, loc="left")
    axes[-1, 0].set_xlabel("time (s)")
    axes[-1, 0].set_xlim(0, max(max((plan_makespan(p) for p in plans.values()), default=0.0), 1e-9) * 1.02)
    handles = [Patch(facecolor=c, edgecolor="black", label=f"CP {size}") for size, c in colours.items()]
    if handles:
        fig.legend(handles=handles, loc="upper right", ncol=min(len(handles), 8), fontsize=8)
    if title:
        fig.suptitle(title, x=0.01, ha="left", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
