"""The plan is data: JSON in the documented shape, round-trips exactly, validates its own fields."""
import json

import pytest

from dcp_megatron.planner import (ClusterSpec, Group, MicroBatch, ModelShape, Recompute, StepPlan, Wave,
                                  cluster_preset, model_preset)


def _plan() -> StepPlan:
    mb_a = MicroBatch(((0, 100), (3, 20)), Recompute("selective"), est_time_s=0.5, est_mem_bytes=10)
    mb_b = MicroBatch(((1, 4000),), Recompute("full", 2), est_time_s=1.25, est_mem_bytes=99)
    mb_c = MicroBatch(((2, 7),), est_time_s=0.1, est_mem_bytes=1)
    wave = Wave((Group(0, 1, (mb_a, mb_c)), Group(1, 2, (mb_b,)), Group(3, 1, ())))
    return StepPlan(domain_size=4, waves=(wave,), est_step_time_s=1.25, lower_bound_s=1.0, policy="dcp")


def test_json_shape_matches_the_documented_format():
    obj = json.loads(_plan().dumps())
    assert set(obj) >= {"domain_size", "est_step_time_s", "lower_bound_s", "waves"}
    group = obj["waves"][0]["groups"][1]
    assert group["first_rank"] == 1 and group["size"] == 2
    mb = group["microbatches"][0]
    assert mb["sequences"] == [[1, 4000]]
    assert mb["recompute"] == {"full_layers": 2}
    assert obj["waves"][0]["groups"][0]["microbatches"][0]["recompute"] == "selective"
    assert obj["waves"][0]["groups"][0]["microbatches"][1]["recompute"] == "none"
    assert isinstance(mb["est_mem_bytes"], int) and isinstance(mb["est_time_s"], float)


def test_round_trip_is_exact_and_bytes_are_stable():
    plan = _plan()
    again = StepPlan.from_json(plan.dumps())
    assert again == plan
    assert again.dumps() == plan.dumps()


def test_rank_queries():
    plan = _plan()
    assert plan.num_microbatches(0) == 2 and plan.num_microbatches(2) == 1 and plan.num_microbatches(3) == 0
    assert [g.first_rank for _, g in plan.rank_schedule(2)] == [1]
    assert plan.cp_size_histogram() == {1: 3, 2: 1}
    assert sorted(plan.sequences()) == [(0, 100), (1, 4000), (2, 7), (3, 20)]
    with pytest.raises(ValueError, match="outside domain"):
        plan.rank_schedule(4)


@pytest.mark.parametrize("bad", [{"full_layers": 0}, "sometimes", {"layers": 2}, 3])
def test_bad_recompute_is_rejected(bad):
    with pytest.raises(ValueError, match="recompute|full_layers"):
        Recompute.from_json(bad)


def test_model_presets_and_flops_facts():
    m = model_preset("llama3-8b")
    # docs/cost_model.md: linear part ≈45 GFLOP/token, attention 786,432·L², equal near L≈57K.
    assert 44e9 < m.linear_flops_per_token < 46e9
    assert m.attn_flops_per_len2 == 786_432
    assert 55_000 < m.linear_flops_per_token / m.attn_flops_per_len2 < 59_000
    with pytest.raises(ValueError, match="unknown model preset 'gpt-huge'"):
        model_preset("gpt-huge")
    with pytest.raises(ValueError, match="num_heads=32 is not divisible by tp=3"):
        model_preset("llama3-8b", tp=3)
    with pytest.raises(ValueError, match="num_layers"):
        ModelShape(num_layers=0, hidden_size=8, num_heads=1, num_kv_heads=1, head_dim=8,
                   ffn_hidden_size=8, vocab_size=8)


def test_cluster_preset_and_validation():
    c = cluster_preset("h200", domain_size=12)
    assert c.domain_size == 12 and c.cp_size_limit == 12
    assert c.same_node(0, 8) and not c.same_node(4, 8)
    assert c.attn_rate(512) < c.attn_rate(4096) < c.attn_rate(1 << 20)
    with pytest.raises(ValueError, match="domain_size"):
        cluster_preset("h200", domain_size=0)
    with pytest.raises(ValueError, match="unknown cluster preset"):
        cluster_preset("tpu", domain_size=8)
    with pytest.raises(ValueError, match="mem_safety_frac"):
        ClusterSpec(domain_size=2, mem_bytes_per_gpu=1, mem_safety_frac=1.5, gemm_flops=1.0,
                    attn_rate_points=((1, 1.0),), intra_node_bw=1.0, inter_node_bw=1.0)
