"""ZeRO stages in the planner (costmodel/param_sharding.py): static memory by stage, stage 3's per-micro-batch weight
gathers, lockstep plans at stage 3, and the simulator's --zero-stage. Worked by hand on a 32B-class model."""
import dataclasses
import json

import numpy as np
import pytest

from dcp_megatron.planner.costmodel import CostModel, ModelShape, cluster_preset, model_preset
from dcp_megatron.planner.costmodel.param_sharding import ParamGathers, largest_gathered_params, static_state_bytes
from dcp_megatron.planner.policies import make_plan
from dcp_megatron.planner.validate import validate
from dcp_megatron.simulate import main

QWEN = model_preset("qwen2.5-32b")


def _at(stage, model=QWEN):
    return dataclasses.replace(model, zero_stage=stage)


def test_static_memory_shards_by_stage():
    cluster = cluster_preset("h200", domain_size=64)
    P, D = QWEN.num_params, 64
    assert abs(P - 32.76e9) < 0.01e9   # the public config's 32.8B
    by_stage = {stage: static_state_bytes(_at(stage), cluster) for stage in (0, 1, 2, 3)}
    assert by_stage[0] == int(P * 18.0)
    assert by_stage[1] == int(P * (2.0 + 4.0 + 12.0 / D))
    assert by_stage[2] == int(P * (2.0 + 16.0 / D))
    # stage 3: everything / D, plus two of the largest gathered unit (here the 152064 x 5120 embedding) with grads
    assert largest_gathered_params(QWEN) == 152064 * 5120
    assert by_stage[3] == int(P * 18.0 / D + 2 * 152064 * 5120 * 6.0)
    # no stage given: the cluster's distributed_optimizer, as before stages existed (1, else 0)
    assert static_state_bytes(QWEN, cluster) == by_stage[1]
    assert static_state_bytes(QWEN, dataclasses.replace(cluster, distributed_optimizer=False)) == by_stage[0]
    # the cost model uses it: ZeRO-1 does not fit an H200 at TP 1, ZeRO-3 leaves room for ~6.9k tokens
    # (per-tensor activations, logits at 6 B per vocab entry)
    costs = {stage: CostModel(_at(stage), cluster) for stage in (1, 3)}
    assert costs[1].max_local_tokens(costs[1].base_recompute) == 0
    assert costs[3].max_local_tokens(costs[3].base_recompute) > 6000
    with pytest.raises(ValueError, match="zero_stage"):
        _at(4)


def test_stage3_charges_the_unhidden_weight_gathers():
    cluster = cluster_preset("h200", domain_size=64)   # 8 nodes: the ring runs at the inter-node rate
    gathers = ParamGathers.of(_at(3), cluster)
    moved = 2.0 * QWEN.num_params * 63 / 64
    assert gathers.pass_seconds == pytest.approx(moved / cluster.inter_node_bw)
    assert gathers.latency_s == pytest.approx(64 * 3 * cluster.collective_latency_s)
    g = gathers.pass_seconds
    # forward gather behind 1/3 of the compute, backward gather + reduce-scatter behind 2/3
    assert gathers.seconds(0.0) == pytest.approx(3 * g + gathers.latency_s)
    assert gathers.seconds(3 * g) == pytest.approx(gathers.latency_s)
    assert gathers.seconds(1.5 * g) == pytest.approx(0.5 * g + g + gathers.latency_s)
    within_node = ParamGathers.of(_at(3), cluster_preset("h200", domain_size=8))
    assert within_node.pass_seconds == pytest.approx(2.0 * QWEN.num_params * 7 / 8 / cluster.intra_node_bw)
    for stage in (None, 0, 1, 2):
        assert not ParamGathers.of(_at(stage), cluster).active
    # a micro-batch pays it: a short one (nothing to hide behind) more than its compute; a long one nothing extra
    three, two = CostModel(_at(3), cluster), CostModel(_at(2), cluster)
    assert three.microbatch_time([512], 1) - two.microbatch_time([512], 1) > 2.5 * g
    assert three.microbatch_time([512, 512], 1) < 2 * three.microbatch_time([512], 1)   # fewer, larger: cheaper
    # the vectorised scorer (the policies' bulk path) charges the same
    local, compute, attn = np.array([512.0, 9000.0]), np.array([0.01, 2.5]), np.array([0.001, 0.3])
    bulk = three.times_from_sums(local, compute, attn, 1, np.zeros(2, dtype=np.int64), three.base_recompute)
    one = [three.time_from_sums(*args, 1, 0, three.base_recompute) for args in zip(local, compute, attn)]
    assert bulk == pytest.approx(one) and bulk[0] > 2.5 * g


def test_stage3_plans_are_lockstep():
    model = _at(3, model_preset("llama3-8b"))
    cluster = cluster_preset("h200", domain_size=8, gpus_per_node=4)
    cost = CostModel(model, cluster)
    assert model.lockstep and not _at(2, model_preset("llama3-8b")).lockstep
    batch = [(i, n) for i, n in enumerate([65536, 30000, 9000, 4096, 4096, 2048, 1500, 700, 300, 200] * 3)]
    for policy in ("static", "static-balanced", "megatron-hybrid", "megatron-dynamic", "dcp"):
        plan = make_plan(policy, batch, cost, max_seq_len=65536)
        validate(plan, batch, cluster, cost)   # one micro-batch per group per wave
        assert all(len(g.microbatches) == 1 for w in plan.waves for g in w.groups), policy
        assert len({plan.num_microbatches(r) for r in range(8)}) == 1, policy
    assert make_plan("dcp", batch, cost, max_seq_len=65536).policy == "dcp"


def test_simulator_zero_stage(tmp_path, capsys):
    out = tmp_path / "z3.json"
    argv = ["--lengths", "builtin:prolong", "--model", "qwen2.5-32b", "--gpus", "16", "--tokens-per-step", "262144",
            "--steps", "2", "--policies", "static,megatron-dynamic,dcp"]
    assert main([*argv, "--zero-stage", "3", "--json", str(out)]) == 0
    assert "ZeRO-3" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["config"]["zero_stage"] == 3
    assert report["policies"]["dcp"]["speedup_vs_static"] >= 1.0
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--zero-stage", "4"])
    assert exit_info.value.code == 2 and "--zero-stage" in capsys.readouterr().err


def test_model_shape_zero_stage_default_keeps_plans():
    """No stage: ModelShape as before (not lockstep), same static memory as ZeRO-1."""
    model = ModelShape(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, ffn_hidden_size=128,
                       vocab_size=256)
    assert model.zero_stage is None and not model.lockstep
    cluster = cluster_preset("cpu", domain_size=2)
    assert CostModel(model, cluster).static_bytes == CostModel(_at(1, model), cluster).static_bytes


def test_a_document_that_fits_nowhere_under_zero3_is_told_to_allow_full_recompute():
    """ZeRO-3 runs recompute shared by each wave (ModelShape.wave_uniform_relief): the advice names it."""
    import dataclasses

    from dcp_megatron.config import DcpConfig, DcpUsageError
    from dcp_megatron.core.planning import check_longest_fits
    from dcp_megatron.planner.costmodel import CostModel, cpu_cluster, model_preset

    shape = dataclasses.replace(model_preset("gpt-tiny"), zero_stage=3)
    cost = CostModel(shape, cpu_cluster(2), allowed_recompute=("none",))
    with pytest.raises(DcpUsageError) as info:
        check_longest_fits(DcpConfig(seq_length=1 << 20, recompute=("none",)), cost)
    assert "allow full recompute (--dcp-recompute)" in str(info.value), info.value
