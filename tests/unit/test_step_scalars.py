"""The dcp/* step scalars of a plan worked out by hand, and a plan re-scored by another cost model."""
import dataclasses

import pytest

from dcp_megatron.planner.costmodel import CostModel
from dcp_megatron.planner.plan import Group, MicroBatch, Recompute, StepPlan, Wave
from dcp_megatron.planner.policies import make_plan
from dcp_megatron.planner.rescore import rescored
from dcp_megatron.runtime.step_scalars import plan_scalars, step_scalars
from tests.support.planner_helpers import tiny_cost


def _plan() -> StepPlan:
    # D = 2. Wave 1: documents 0 (5 tokens) on CP 2 with full recompute of 1 layer. Wave 2: rank 0 runs
    # documents 1 (3) and 2 (4), then document 4 (8); rank 1 runs document 3 (7). No recompute.
    full = Recompute("full", 1)
    return StepPlan(domain_size=2, est_step_time_s=3.0, lower_bound_s=2.0, policy="dcp", waves=(
        Wave((Group(0, 2, (MicroBatch(((0, 5),), full, 1.0),)),)),
        Wave((Group(0, 1, (MicroBatch(((1, 3), (2, 4))), MicroBatch(((4, 8),)))), Group(1, 1, (MicroBatch(((3, 7),)),)))),
    ))


def test_plan_scalars_by_hand():
    s = plan_scalars(_plan())
    assert s["dcp/cp_size_min"] == 1 and s["dcp/cp_size_max"] == 2
    assert s["dcp/sequences_cp1"] == 4 and s["dcp/sequences_cp2"] == 1
    assert s["dcp/microbatches_per_rank_min"] == 2 and s["dcp/microbatches_per_rank_max"] == 3   # rank 1: 2, rank 0: 3
    assert s["dcp/recompute_share"] == pytest.approx(1 / 4)
    assert s["dcp/tokens"] == 27
    # padding to a multiple of 2c: 5 -> 8 at CP 2 (3), 3 -> 4 (1), 7 -> 8 (1), 4 and 8 none
    assert s["dcp/tokens_padded"] == 5
    assert s["dcp/predicted_step_s"] == 3.0 and s["dcp/lower_bound_ratio"] == 1.5 and s["dcp/fallback"] == 0.0
    # sequence parallelism pads every document to 2c·tp: at tp 4, 5 -> 16, 3 -> 8, 4 -> 8, 8 -> 8, 7 -> 8
    assert plan_scalars(_plan(), pad_multiple=4)["dcp/tokens_padded"] == 11 + 5 + 4 + 0 + 1


def test_step_scalars_add_the_measured_and_planning_times():
    plan = dataclasses.replace(_plan(), extra={"fallback": "static"})
    s = step_scalars(plan, measured_s=4.0, planning_s=0.5, exposed_planning_s=0.1, predicted_unrefined_s=2.5)
    assert s["dcp/measured_step_s"] == 4.0 and s["dcp/prediction_error"] == pytest.approx(0.25)
    assert s["dcp/planning_s"] == 0.5 and s["dcp/exposed_planning_s"] == 0.1
    assert s["dcp/predicted_unrefined_s"] == 2.5 and s["dcp/fallback"] == 1.0
    assert all(tag.startswith("dcp/") for tag in s)


def test_rescored_plan_takes_the_other_models_times():
    from tests.unit.test_planner_policies import long_tailed_batch

    batch = long_tailed_batch(0)
    fast = tiny_cost(4)
    slow = CostModel(fast.model, dataclasses.replace(fast.cluster, microbatch_overhead_s=0.05))   # only this differs
    plan = make_plan("dcp", batch, fast, max_seq_len=24000)
    again = rescored(plan, slow)
    assert [g.size for w in again.waves for g in w.groups] == [g.size for w in plan.waves for g in w.groups]
    assert again.est_step_time_s > plan.est_step_time_s + 0.05
    assert rescored(plan, fast).est_step_time_s == pytest.approx(plan.est_step_time_s)
