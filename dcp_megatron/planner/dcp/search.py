"""dcp's plan: its own layout, or a seeded alternative when that is faster, so dcp never loses to a baseline.

Besides its own layout (own_layout.py), dcp plans every baseline at its default setting and at the run-wide
settings `tuned` names (a run's tuned ones: the simulator passes its sweep winners). Each such layout gets every
micro-batch's own cheapest relief (relief_pass.py); it is dcp's plan (extra["seeded_from"] naming the seed) when a
relief changed, the baseline's (extra["fallback"]) when nothing did. Under ZeRO-3 dev's layout at the caps of a
few wave counts are seeds too (lockstep_seeds.py). The fastest plan wins; dcp's own on a tie.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from dcp_megatron.planner.baselines import BASELINES, SETTING_KINDS
from dcp_megatron.planner.baselines.settings import StaticSetting
from dcp_megatron.planner.baselines.static import static_packing
from dcp_megatron.planner.dcp.lockstep_seeds import lockstep_seeds
from dcp_megatron.planner.dcp.own_layout import plan_dcp
from dcp_megatron.planner.dcp.relief_pass import with_own_reliefs
from dcp_megatron.planner.dcp.split import assign_shares, compose, part_cost, share_of, split_parts
from dcp_megatron.planner.layout import finish_plan
from dcp_megatron.planner.plan import StepPlan


def plan_dcp_search(ids: np.ndarray, lengths: np.ndarray, cost, *, max_seq_len: int, tuned: dict,
                    bound: float, part_ranks: int = 0) -> StepPlan:
    """The fastest of dcp's own plan and its seeded alternatives (module docstring); `bound` the batch's lower
    bound, recorded on the plan; `part_ranks` > 0 plans a large domain in parts of that many ranks (split.py)."""
    part_ranks = split_parts(lengths, cost, part_ranks, bound)
    if not part_ranks:
        best = finish_plan("dcp", plan_dcp(ids, lengths, cost, max_seq_len=max_seq_len), cost, bound)
        return with_seeds(best, ids, lengths, cost, max_seq_len=max_seq_len, tuned=tuned, bound=bound)
    num_parts = cost.cluster.domain_size // part_ranks
    part_of = assign_shares(ids, lengths, cost, num_parts)
    return compose([plan_part(ids, lengths, cost, part_of, p, max_seq_len=max_seq_len, part_ranks=part_ranks,
                              bound=bound) for p in range(num_parts)], cost, bound)


def plan_part(ids: np.ndarray, lengths: np.ndarray, cost, part_of: np.ndarray, part: int, *, max_seq_len: int,
              part_ranks: int, bound: float) -> StepPlan:
    """dcp's plan of one part's share on the part's cost model (split.py): its own layout and the part-sized seeds
    at their defaults: dcp never loses to a baseline on its part. (The whole domain's seeds are not planned: at
    0.3 s a plan at 16,384 ranks they cost more than a part, and at 4,096 and 16,384 ranks they never won.)"""
    sel = share_of(part_of, part)
    return plan_dcp_search(ids[sel], lengths[sel], part_cost(cost, part_ranks), max_seq_len=max_seq_len, tuned={},
                           bound=bound)


def with_seeds(best: StepPlan, ids: np.ndarray, lengths: np.ndarray, cost, *, max_seq_len: int, tuned: dict,
               bound: float) -> StepPlan:
    """`best`, or a seeded alternative of the whole domain where it ends sooner (module docstring)."""
    for name, waves in _baseline_layouts(ids, lengths, cost, max_seq_len, tuned, lambda: best.est_step_time_s):
        own, changed = with_own_reliefs(waves, cost)
        other = finish_plan("dcp", own, cost, bound, extra={"seeded_from": name} if changed else {"fallback": name})
        if other.est_step_time_s < best.est_step_time_s:
            best = other
    if cost.model.wave_uniform_relief:
        for name, waves in lockstep_seeds(ids, lengths, cost, best.est_step_time_s, max_seq_len):
            other = finish_plan("dcp", waves, cost, bound, extra={"seeded_from": name})
            if other.est_step_time_s < best.est_step_time_s:
                best = other
    return best


def _baseline_layouts(ids, lengths, cost, max_seq_len: int, tuned: dict, must_beat: Callable[[], float]):
    """(seed name, waves) of each baseline at its default setting and at its `tuned` one, for those that may beat
    `must_beat()` (read at each call: the best plan so far; it lets a baseline that cannot win skip building its
    plan objects)."""
    try:
        packing = static_packing(ids, lengths, cost, max_seq_len)
    except ValueError:
        packing = None                # no static layout holds the cap: the static defaults cannot run
    for name, planner in BASELINES.items():
        seeds = [(name, None)] if packing is not None or SETTING_KINDS[name] is not StaticSetting else []
        seeds += [(f"{name}@tuned", tuned[name])] if name in tuned else []
        for seed, setting in seeds:
            try:
                waves = planner(ids, lengths, cost, max_seq_len=max_seq_len, must_beat=must_beat(), setting=setting,
                                packing=packing if setting is None else None)   # packing: the static default's
            except ValueError:        # this setting cannot hold this batch: no contender here
                continue
            if waves is not None:
                yield seed, waves
