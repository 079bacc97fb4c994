"""The sweep's step times (planner/baselines/sweep_scoring.py) are make_plan's, bit for bit, at every grid point.

The scorer makes each layout once per batch and knob and times it under every relief of the grid; a cached layout
keyed by too little, a relief left out of the timing, or times summed in another order would show here as a step
time that differs from the plan's (or a setting that runs where the plan refuses, or the reverse).
"""
import itertools

import pytest

from dcp_megatron.planner.baselines.settings import DynamicSetting, StaticSetting
from dcp_megatron.planner.baselines.sweep import SWEPT_POLICIES, grid_of
from dcp_megatron.planner.baselines.sweep_scoring import SettingScorer
from dcp_megatron.planner.batcher import GlobalBatcher
from dcp_megatron.planner.costmodel import MENU_NAMES, CostModel, cluster_preset, model_preset
from dcp_megatron.planner.distributions import iter_builtin_lengths
from dcp_megatron.planner.plan import NO_RECOMPUTE
from dcp_megatron.planner.policies import make_plan
from tests.support.planner_helpers import tiny_cost


def _batches(mix: str, tokens: int, count: int):
    batcher = GlobalBatcher(tokens_per_step=tokens, max_seq_len=tokens, overlong="split")
    batches = [b.sequences for b in itertools.islice(batcher.batches(enumerate(iter_builtin_lengths(mix, 0))), count)]
    return batches, max(length for b in batches for _, length in b)


def _outcome(call):
    try:
        return call()
    except ValueError as err:
        return f"ValueError: {err}"


def _refused(policy: str, cost) -> list:
    """Settings off the grid that cannot run: no relief with CP 1 or at a cap over memory, a cap no CP size holds
    the longest sequence at."""
    if policy in StaticSetting.POLICIES:
        return [StaticSetting(cp_size=1, recompute=NO_RECOMPUTE)]
    most = cost.max_local_tokens(NO_RECOMPUTE)
    return [DynamicSetting(token_cap=most + 1, recompute=NO_RECOMPUTE),
            DynamicSetting(token_cap=2, recompute=NO_RECOMPUTE)]


CASES = {
    # two H200 nodes, the whole relief menu: offload groups across nodes (their times are added in another order)
    "h200-16-bytescale": (lambda: CostModel(model_preset("llama3-8b"), cluster_preset("h200", domain_size=16),
                                            allowed_recompute=MENU_NAMES), "bytescale", 16 * 16384),
    # four nodes of 4: here two of hybrid's offload settings' steps are an ulp apart when timed all at once
    "h200-4x4-wikipedia": (lambda: CostModel(model_preset("llama3-8b"), cluster_preset(
        "h200", domain_size=16, gpus_per_node=4), allowed_recompute=MENU_NAMES), "wikipedia", 16 * 16384),
    # lockstep (PP 2: idle ranks run fillers), memory tight enough that caps and CP sizes fail
    "tiny-4-pp2": (lambda: tiny_cost(4, pp=2), "wikipedia", 4 * 4096),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_grid_point_scores_what_make_plan_gives(case):
    make_cost, mix, tokens = CASES[case]
    cost = make_cost()
    batches, cap = _batches(mix, tokens, 2)
    compared, refused = 0, 0
    for policy in SWEPT_POLICIES:
        scorer = SettingScorer(policy, batches, cost, max_seq_len=cap)
        # by name: a knob's reliefs and the knobs sharing a cap or CP size come one after another (cache hits)
        for setting in sorted(grid_of(policy, cost, cap) + _refused(policy, cost), key=str):
            for j, batch in enumerate(batches):
                fast = _outcome(lambda: scorer(j, setting))
                plan = _outcome(lambda: make_plan(policy, batch, cost, max_seq_len=cap, setting=setting))
                want = plan if isinstance(plan, str) else plan.est_step_time_s
                assert fast == want, (policy, str(setting), j)
                compared += isinstance(want, float)
                refused += isinstance(want, str)
    assert compared >= 100 and refused >= 8, (compared, refused)
