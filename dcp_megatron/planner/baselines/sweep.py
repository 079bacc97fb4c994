"""Baselines tuned as their users tune them: one run-wide setting per baseline, swept over a run's batches.

A user of Megatron's static layout or of dev's dynamic CP sets its knobs once for the run (they cannot change
per step) and, tuning, keeps the setting with the lowest mean step over the run's batches within the memory
budget. `sweep` does that over a grid and returns every point and the winner:

- `static`, `static-balanced` (`StaticSetting`): every CP size dividing the domain up to the max CP size, each
  with every recompute that can hold a micro-batch of one run-length sequence: none, selective, and, when
  none does not fit, the fewest full layers that fit (more full layers only add time to the same layout).
- `megatron-dynamic` (`DynamicSetting`): per-rank token caps (`max_seqlen_per_dp_cp_rank`: 256 x 2^(k/2)
  rounded to 256, and the most tokens each light relief (none, module recompute, offload), the strongest recompute and the fewest 1-4 full
  layers that hold the longest sequence allow, from that sequence's share of the largest CP size up to what
  memory allows: so the untuned default is a point of the grid), the smallest dynamic CP size (1, 2), and per cap every run-wide recompute that fits it
  (the light reliefs that hold it, else the fewest full layers that fit). `megatron-hybrid`: the same caps and recompute (it has no
  smallest-size knob). A cap below the longest sequence's share of the largest CP size cannot run.
- The run-wide reliefs come from the cost model's menu (costmodel/relief.py): module recompute such as `mlp`, offload
  where the cluster has a host link, and full layers; every micro-batch of the run pays the one chosen.

A setting is scored by the mean over the batches of the plan's modelled step time (the same cost model that
scores every policy; `sweep_scoring.SettingScorer` gives that float without building the plan, each layout made
once per batch and layout knob and timed under every relief). The untuned default is scored first; a point whose
running sum passes the best full sum so far is stopped there (it cannot win; printed as such). Ties keep the
grid's first point.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from dcp_megatron.planner.plan import NO_RECOMPUTE
from dcp_megatron.planner.baselines.settings import DynamicSetting, StaticSetting, check_recompute_fits, token_caps  # noqa: F401

STATIC_POLICIES = ("static", "static-balanced")
DYNAMIC_POLICIES = ("megatron-dynamic", "megatron-hybrid")
SWEPT_POLICIES = STATIC_POLICIES + DYNAMIC_POLICIES
MIN_CP_SIZES = (1, 2)


@dataclass(frozen=True)
class SweepPoint:
    setting: StaticSetting | DynamicSetting
    mean_step_s: float | None     # None: stopped early or cannot run (see `note`)
    note: str = ""


@dataclass(frozen=True)
class SweepResult:
    policy: str
    points: tuple[SweepPoint, ...]
    winner: StaticSetting | DynamicSetting
    winner_mean_step_s: float
    num_batches: int

    def to_json(self) -> dict:
        return {"winner": str(self.winner), "winner_mean_step_s": self.winner_mean_step_s,
                "num_batches": self.num_batches,
                "grid": [{"setting": str(p.setting), "mean_step_s": p.mean_step_s, "note": p.note}
                         for p in self.points]}


def _recompute_candidates(cost, local_tokens: int) -> list:
    """Run-wide recompute settings worth trying for micro-batches of up to `local_tokens` per rank."""
    room = cost.cluster.mem_budget_bytes - cost.static_bytes
    out = [r for r in cost.recompute_options() if r.kind != "full" and cost.max_local_tokens(r) >= local_tokens]
    if "full" in cost.allowed_recompute and (not out or out[0] is not NO_RECOMPUTE):
        k = cost.relief.fewest_full_layers(float(local_tokens), room)
        if k is not None:
            out.append(cost.full_recompute_options()[k - 1])
    return out


def static_grid(cost, max_seq_len: int) -> list[StaticSetting]:
    from dcp_megatron.planner.layout import divisor_sizes
    from dcp_megatron.planner.padding import local_tokens

    grid = []
    for c in divisor_sizes(cost.cluster):
        capacity = int(local_tokens(np.array([max_seq_len]), c)[0])
        grid += [StaticSetting(cp_size=c, recompute=r) for r in _recompute_candidates(cost, capacity)]
    return grid


def dynamic_grid(cost, max_seq_len: int, policy: str = "megatron-dynamic") -> list[DynamicSetting]:
    from dcp_megatron.planner.baselines.hybrid import hybrid_cp_sizes
    from dcp_megatron.planner.baselines.megatron_dynamic import dynamic_cp_sizes

    D, limit = cost.cluster.domain_size, cost.cluster.cp_size_limit
    top = (dynamic_cp_sizes if policy == "megatron-dynamic" else hybrid_cp_sizes)(D, limit)[-1]
    smallest = [s for s in MIN_CP_SIZES if s <= top] if policy == "megatron-dynamic" else [1]
    return [DynamicSetting(token_cap=int(cap), recompute=r, min_cp_size=m)
            for m in smallest for cap in token_caps(cost, max_seq_len, top) for r in _recompute_candidates(cost, cap)]


def grid_of(policy: str, cost, max_seq_len: int) -> list:
    if policy in STATIC_POLICIES:
        return static_grid(cost, max_seq_len)
    if policy in DYNAMIC_POLICIES:
        return dynamic_grid(cost, max_seq_len, policy)
    raise ValueError(f"policy {policy!r} has no run-wide setting to sweep; sweepable: {', '.join(SWEPT_POLICIES)}")


def sweep(policy: str, batches: Sequence[Sequence[tuple[int, int]]], cost, *, max_seq_len: int,
          grid: Sequence | None = None, score: Callable[[int, object], float] | None = None) -> SweepResult:
    """The setting of `grid` (default `grid_of`) with the lowest mean step over `batches`, and every point.
    `score(j, setting)`: batch j's step time under the setting (default: its plan's, by the cost model;
    ValueError: the setting cannot run it)."""
    from dcp_megatron.planner.baselines.sweep_scoring import SettingScorer

    if not batches:
        raise ValueError("sweep needs at least one batch")
    grid = list(grid_of(policy, cost, max_seq_len) if grid is None else grid)
    if not grid:
        raise ValueError(f"{policy}: no setting of the grid can hold max_seq_len {max_seq_len} in memory")
    # make_plan's step time, each layout made once per batch and layout knob (sweep_scoring.py)
    scorer = SettingScorer(policy, batches, cost, max_seq_len=max_seq_len)     # checks the batches
    step_time = score or scorer
    # The untuned default first when it is a grid point: its total then stops slower points early.
    first = grid.index(default) if (default := _default_setting(policy, cost, max_seq_len)) in grid else 0
    best_total, best, points = math.inf, None, [None] * len(grid)
    for i in [first] + [i for i in range(len(grid)) if i != first]:
        setting, total, note = grid[i], 0.0, ""
        try:
            for j in range(len(batches)):
                total += step_time(j, setting)
                if total > best_total * (1 + 1e-12) and j + 1 < len(batches):
                    note = f"stopped after {j + 1} of {len(batches)} batches: slower than the best"
                    break
        except ValueError as err:
            note = f"cannot run: {err}"
        if note:
            points[i] = SweepPoint(setting, None, note)
            continue
        points[i] = SweepPoint(setting, total / len(batches))
        if total < best_total or (total == best_total and i < grid.index(best)):   # ties: the grid's first
            best_total, best = total, setting
    if best is None:
        raise ValueError(f"{policy}: no setting of the grid runs every batch: {points[0].note}")
    return SweepResult(policy, tuple(points), best, best_total / len(batches), len(batches))


def _default_setting(policy: str, cost, max_seq_len: int):
    """The setting the policy plans with when given none (None when that is no single setting)."""
    from dcp_megatron.planner.baselines.hybrid import hybrid_cp_sizes
    from dcp_megatron.planner.baselines.megatron_dynamic import dynamic_cp_sizes
    from dcp_megatron.planner.baselines.settings import default_dynamic_setting
    from dcp_megatron.planner.baselines.static import static_layout

    D, limit = cost.cluster.domain_size, cost.cluster.cp_size_limit
    try:
        if policy in STATIC_POLICIES:
            layout = static_layout(cost, max_seq_len)
            return StaticSetting(cp_size=layout.cp_size, recompute=layout.recompute)
        sizes = (dynamic_cp_sizes if policy == "megatron-dynamic" else hybrid_cp_sizes)(D, limit)
        return default_dynamic_setting(cost, max_seq_len, sizes)
    except ValueError:
        return None


def format_sweep(result: SweepResult, *, grid: bool = True) -> str:
    """The sweep's winner in one line and, with `grid`, every point under it (one line each)."""
    lines = [f"{result.policy}: {len(result.points)} run-wide settings over {result.num_batches} batches; "
             f"winner {result.winner} (mean step {result.winner_mean_step_s:.3f} s)"]
    if not grid:
        return lines[0]
    for p in result.points:
        mark = "*" if p.setting == result.winner else " "
        value = f"{p.mean_step_s:9.3f} s" if p.mean_step_s is not None else "        - "
        lines.append(f"  {mark} {str(p.setting):<40} {value}  {p.note}".rstrip())
    return "\n".join(lines)
