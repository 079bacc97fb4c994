"""Layout policies: each turns one global batch's lengths into a validated-shape StepPlan.

All are scored by the same CostModel. `make_plan` fills every micro-batch's estimates, the
plan's est_step_time_s (the per-rank timeline's makespan) and lower_bound_s. `dcp` also
plans the baselines at their default settings, and at the run-wide settings `baseline_settings` names
(a run's tuned ones: the simulator passes its sweep winners), and returns the fastest of them
(re-labelled, with extra["fallback"] naming it, or extra["seeded_from"] when its own reliefs changed the
layout's) whenever its own plan would be slower, so it never loses to those baselines. A baseline's run-wide
setting (policies/settings.py) is `setting=`; planner/baseline_sweep.py tunes it over a run's batches.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from dcp_megatron.planner.plan import StepPlan
from dcp_megatron.planner.policies.common import candidate_sizes, check_batch, min_fitting_size
from dcp_megatron.planner.policies.cp_flavour import choose_cp_attention
from dcp_megatron.planner.policies.dcp import plan_dcp
from dcp_megatron.planner.policies.hybrid import plan_megatron_hybrid
from dcp_megatron.planner.policies.lockstep_seeds import lockstep_seeds
from dcp_megatron.planner.policies.megatron_dynamic import plan_megatron_dynamic
from dcp_megatron.planner.policies.relief_pass import with_own_reliefs
from dcp_megatron.planner.policies.settings import DynamicSetting, StaticSetting
from dcp_megatron.planner.policies.static import plan_static, plan_static_balanced, static_packing
from dcp_megatron.planner.timeline import plan_makespan

BASELINES: dict[str, Callable] = {
    "static": plan_static,
    "static-balanced": plan_static_balanced,
    "megatron-hybrid": plan_megatron_hybrid,
    "megatron-dynamic": plan_megatron_dynamic,
}
POLICIES: tuple[str, ...] = tuple(BASELINES) + ("dcp",)
SETTING_KINDS: dict[str, type] = {"static": StaticSetting, "static-balanced": StaticSetting,
                                  "megatron-hybrid": DynamicSetting, "megatron-dynamic": DynamicSetting}


def make_plan(policy: str, batch: Sequence[tuple[int, int]], cost, *, max_seq_len: int,
              setting: StaticSetting | DynamicSetting | None = None,
              baseline_settings: dict | None = None) -> StepPlan:
    """Plan one global batch [(sample_id, length)] with the named policy.

    max_seq_len is the run's length cap (the static layouts are chosen from it once per run);
    `setting` a baseline's run-wide setting (None: its default; `dcp` takes none);
    `baseline_settings` ({baseline: setting}, `dcp` only) the run-wide settings of baselines dcp must not lose
    to besides their defaults (seeds named `<baseline>@tuned`; one that cannot run this batch is no contender);
    ValueError for an unknown policy, bad lengths, repeated ids, a sequence over the cap, or a
    setting of the wrong kind or that cannot run."""
    from dcp_megatron.planner.bounds import lower_bound_of_lengths   # bounds uses policies.common

    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    ids, lengths = check_batch(batch)
    if not isinstance(max_seq_len, (int, np.integer)) or isinstance(max_seq_len, bool) or max_seq_len <= 0:
        raise ValueError(f"max_seq_len must be a positive int, got {max_seq_len!r}")
    max_seq_len = int(max_seq_len)
    longest = int(lengths.max())
    if longest > max_seq_len:
        j = int(lengths.argmax())
        raise ValueError(f"sample {int(ids[j])} has {longest} tokens, over the run's max_seq_len {max_seq_len}")
    if setting is not None and not isinstance(setting, SETTING_KINDS.get(policy, ())):
        kind = SETTING_KINDS.get(policy)
        raise ValueError(f"policy {policy!r} takes " + (f"a {kind.__name__}" if kind else "no setting")
                         + f", got {setting!r}")
    tuned = dict(baseline_settings or {})
    if tuned and policy != "dcp":
        raise ValueError(f"baseline_settings are for policy 'dcp' (what it must not lose to), not {policy!r}")
    for name, value in tuned.items():
        if not isinstance(value, SETTING_KINDS.get(name, ())):
            raise ValueError(f"baseline_settings[{name!r}]: expected a setting of one of {', '.join(SETTING_KINDS)}, "
                             f"got {value!r}")
    min_fitting_size(lengths, ids, candidate_sizes(cost.cluster), cost)   # names a sequence that fits nowhere
    bound = lower_bound_of_lengths(lengths, cost)
    if policy != "dcp":
        return _finish(policy, BASELINES[policy](ids, lengths, cost, max_seq_len=max_seq_len, setting=setting),
                       cost, bound)
    best = _finish("dcp", plan_dcp(ids, lengths, cost, max_seq_len=max_seq_len), cost, bound)
    for name, waves in _baseline_layouts(ids, lengths, cost, max_seq_len, tuned, lambda: best.est_step_time_s):
        # seeded with the baseline's layout, each micro-batch with its own cheapest relief (relief_pass.py):
        # dcp's plan when a relief changed, the baseline's (a fallback) when nothing did
        own, changed = with_own_reliefs(waves, cost)
        other = _finish("dcp", own, cost, bound, extra={"seeded_from": name} if changed else {"fallback": name})
        if other.est_step_time_s < best.est_step_time_s:
            best = other
    if cost.model.wave_uniform_relief:   # ZeRO-3: dev's layout at the caps of a few wave counts (lockstep_seeds.py)
        for name, waves in lockstep_seeds(ids, lengths, cost, best.est_step_time_s, max_seq_len):
            other = _finish("dcp", waves, cost, bound, extra={"seeded_from": name})
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


def _finish(policy: str, waves, cost, bound: float, extra: dict | None = None) -> StepPlan:
    waves = choose_cp_attention(waves, cost)   # the CP flavour each estimate was scored with
    plan = StepPlan(domain_size=cost.cluster.domain_size, waves=waves, lower_bound_s=bound, policy=policy,
                    extra=extra or {})
    return StepPlan(domain_size=plan.domain_size, waves=waves, est_step_time_s=plan_makespan(plan),
                    lower_bound_s=bound, policy=policy, extra=extra or {})
