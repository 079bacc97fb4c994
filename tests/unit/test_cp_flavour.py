"""Ulysses as a second CP attention flavour in the planner: its limits, its cost, the choice per micro-batch."""
import dataclasses
import random

import pytest

from dcp_megatron.planner.costmodel import CostModel, cluster_preset
from dcp_megatron.planner.costmodel.model import ModelShape, kv_heads_exchanged, model_preset, ulysses_supported
from dcp_megatron.planner.plan import StepPlan
from dcp_megatron.planner.policies import make_plan
from dcp_megatron.planner.timeline import plan_makespan
from dcp_megatron.planner.validate import PlanError, validate

# Multi-head (no GQA), nodes of 2 GPUs and 8 GiB per rank: a 64K document needs a CP group of 8 across four
# nodes, whose K/V all-gathers the attention cannot hide; Ulysses moves 4x fewer bytes there.
MHA = ModelShape(num_layers=8, hidden_size=2048, num_heads=16, num_kv_heads=16, head_dim=128, ffn_hidden_size=5632,
                 vocab_size=32000)


def _cluster(**changes):
    changes.setdefault("mem_bytes_per_gpu", 8 * 2 ** 30)
    return dataclasses.replace(cluster_preset("h200", domain_size=8, gpus_per_node=2), **changes)


def test_head_limits():
    assert ulysses_supported(32, 8, 8) and ulysses_supported(32, 8, 16) and not ulysses_supported(32, 8, 3)
    assert kv_heads_exchanged(32, 8, 4) == 8 and kv_heads_exchanged(32, 8, 16) == 32   # replicated past 8


def test_ulysses_time_only_where_it_may_run():
    allgather_only = CostModel(MHA, _cluster())
    both = CostModel(MHA, _cluster(), cp_attention=("allgather", "ulysses"))
    assert allgather_only.ulysses_time([4096], 4) is None          # not allowed
    assert both.ulysses_time([4096], 1) is None                    # no group
    assert both.ulysses_time([4096], 3) is None                    # 16 heads do not split over 3
    assert both.ulysses_time([4096], 4) > both.ulysses_time([4096], 8)
    with pytest.raises(ValueError, match="unknown flavour"):
        CostModel(MHA, _cluster(), cp_attention=("allgather", "a2a"))


def test_ulysses_moves_fewer_bytes_than_the_all_gather_on_wide_mha_groups():
    # MHA at c = 8: the all-gather receives 7 x the local K/V, Ulysses sends 7/8 of q, k, v, out.
    cost = CostModel(MHA, _cluster(), cp_attention=("allgather", "ulysses"))
    allgather = CostModel(MHA, _cluster())
    assert cost.ulysses_time([2048] * 8, 8) < allgather.microbatch_time([2048] * 8, 8)
    # the cost model charges the faster flavour
    assert cost.microbatch_time([2048] * 8, 8) == pytest.approx(cost.ulysses_time([2048] * 8, 8))
    # GQA with 8 KV heads on 2 ranks: the all-gather moves less and hides it
    gqa = CostModel(model_preset("llama3-8b"), _cluster(), cp_attention=("allgather", "ulysses"))
    gqa_allgather = CostModel(model_preset("llama3-8b"), _cluster())
    assert gqa.ulysses_time([65536], 2) > gqa_allgather.microbatch_time([65536], 2)
    assert gqa.microbatch_time([65536], 2) == gqa_allgather.microbatch_time([65536], 2)


def _batch(seed):
    rng = random.Random(seed)
    return [(i, rng.choice([1024, 2048, 4096, 65536])) for i in range(24)]


@pytest.mark.parametrize("seed", range(4))
def test_planner_picks_ulysses_where_faster_and_never_loses(seed):
    batch = _batch(seed)
    cluster = _cluster()
    allgather = make_plan("dcp", batch, CostModel(MHA, cluster), max_seq_len=65536)
    cost = CostModel(MHA, cluster, cp_attention=("allgather", "ulysses"))
    plan = make_plan("dcp", batch, cost, max_seq_len=65536)
    validate(plan, batch, cost.cluster, cost)
    assert plan.est_step_time_s <= allgather.est_step_time_s + 1e-12
    for wave in plan.waves:
        for group in wave.groups:
            for mb in group.microbatches:
                if mb.attention == "ulysses":
                    assert group.size > 1 and mb.est_time_s == pytest.approx(cost.ulysses_time(
                        mb.lengths, group.size, first_rank=group.first_rank, recompute=mb.recompute))
    assert StepPlan.from_json(plan.dumps()).dumps() == plan.dumps()   # the flavour survives the plan JSON
    assert ('"attention":"ulysses"' in plan.dumps()) == any(
        mb.attention == "ulysses" for w in plan.waves for g in w.groups for mb in g.microbatches)


def test_ulysses_plans_are_faster_where_the_all_gather_is_exposed():
    cost = CostModel(MHA, _cluster(), cp_attention=("allgather", "ulysses"))
    allgather = CostModel(MHA, _cluster())
    for seed in range(4):
        plan = make_plan("dcp", _batch(seed), cost, max_seq_len=65536)
        assert any(mb.attention == "ulysses" for w in plan.waves for g in w.groups for mb in g.microbatches)
        assert plan.est_step_time_s < 0.9 * make_plan("dcp", _batch(seed), allgather, max_seq_len=65536).est_step_time_s


def test_forcing_ulysses_puts_it_on_every_splittable_group():
    forced = CostModel(MHA, _cluster(), cp_attention=("ulysses",))
    plan = make_plan("dcp", _batch(0), forced, max_seq_len=65536)
    validate(plan, _batch(0), forced.cluster, forced)
    for w in plan.waves:
        for g in w.groups:
            for mb in g.microbatches:
                if mb.sequences and g.size > 1:
                    assert mb.attention == "ulysses"
    assert plan.est_step_time_s == pytest.approx(plan_makespan(plan))


def test_validate_refuses_a_flavour_the_run_does_not_allow():
    cost = CostModel(MHA, _cluster(), cp_attention=("allgather", "ulysses"))
    batch = _batch(1)
    plan = make_plan("dcp", batch, cost, max_seq_len=65536)
    assert any(mb.attention == "ulysses" for w in plan.waves for g in w.groups for mb in g.microbatches)
    with pytest.raises(PlanError, match="cp attention"):
        validate(plan, batch, cost.cluster, CostModel(MHA, _cluster()))
