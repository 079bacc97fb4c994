"""The layout policies by name: each turns one global batch's lengths into a StepPlan scored by one CostModel.

The baselines (baselines/: static, static-balanced, megatron-hybrid, megatron-dynamic) take a run-wide setting
(`setting=`, baselines/settings.py; baselines/sweep.py tunes it over a run's batches); `dcp` (dcp/) plans per
batch and never loses to a baseline (dcp/search.py). `make_plan` checks the batch once, then hands it to the named
policy; every plan carries its micro-batches' estimates, est_step_time_s (the per-rank timeline's makespan) and
lower_bound_s.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from dcp_megatron.planner.baselines import BASELINES, SETTING_KINDS
from dcp_megatron.planner.baselines.settings import DynamicSetting, StaticSetting
from dcp_megatron.planner.bounds import lower_bound_of_lengths
from dcp_megatron.planner.dcp.search import plan_dcp_search
from dcp_megatron.planner.layout import candidate_sizes, check_batch, finish_plan, min_fitting_size
from dcp_megatron.planner.plan import StepPlan

POLICIES: tuple[str, ...] = tuple(BASELINES) + ("dcp",)


def make_plan(policy: str, batch: Sequence[tuple[int, int]], cost, *, max_seq_len: int,
              setting: StaticSetting | DynamicSetting | None = None,
              baseline_settings: dict | None = None, part_ranks: int = 0) -> StepPlan:
    """Plan one global batch [(sample_id, length)] with the named policy.

    max_seq_len is the run's length cap (the static layouts are chosen from it once per run);
    `setting` a baseline's run-wide setting (None: its default; `dcp` takes none);
    `baseline_settings` ({baseline: setting}, `dcp` only) the run-wide settings of baselines dcp must not lose
    to besides their defaults (seeds named `<baseline>@tuned`; one that cannot run this batch is no contender);
    `part_ranks` (`dcp` only) > 0 plans a large domain in parts of that many ranks where it may (dcp/split.py);
    ValueError for an unknown policy, bad lengths, repeated ids, a sequence over the cap, or a
    setting of the wrong kind or that cannot run."""
    ids, lengths, max_seq_len, tuned, bound = checked_inputs(policy, batch, cost, max_seq_len=max_seq_len,
                                                             setting=setting, baseline_settings=baseline_settings,
                                                             part_ranks=part_ranks)
    if policy == "dcp":
        return plan_dcp_search(ids, lengths, cost, max_seq_len=max_seq_len, tuned=tuned, bound=bound,
                               part_ranks=part_ranks)
    return finish_plan(policy, BASELINES[policy](ids, lengths, cost, max_seq_len=max_seq_len, setting=setting),
                       cost, bound)


def checked_inputs(policy: str, batch: Sequence[tuple[int, int]], cost, *, max_seq_len: int,
                   setting: StaticSetting | DynamicSetting | None = None, baseline_settings: dict | None = None,
                   part_ranks: int = 0) -> tuple[np.ndarray, np.ndarray, int, dict, float]:
    """make_plan's checks (its docstring): (ids, lengths, max_seq_len, tuned settings, the batch's lower bound)."""
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
    if not isinstance(part_ranks, (int, np.integer)) or isinstance(part_ranks, bool) or part_ranks < 0:
        raise ValueError(f"part_ranks must be an int >= 0 (0: plan the domain whole), got {part_ranks!r}")
    if part_ranks and policy != "dcp":
        raise ValueError(f"part_ranks is for policy 'dcp' (a baseline plans its domain whole), not {policy!r}")
    tuned = dict(baseline_settings or {})
    if tuned and policy != "dcp":
        raise ValueError(f"baseline_settings are for policy 'dcp' (what it must not lose to), not {policy!r}")
    for name, value in tuned.items():
        if not isinstance(value, SETTING_KINDS.get(name, ())):
            raise ValueError(f"baseline_settings[{name!r}]: expected a setting of one of {', '.join(SETTING_KINDS)}, "
                             f"got {value!r}")
    min_fitting_size(lengths, ids, candidate_sizes(cost.cluster), cost)   # names a sequence that fits nowhere
    return ids, lengths, max_seq_len, tuned, lower_bound_of_lengths(lengths, cost)
