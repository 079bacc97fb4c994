"""Mixture-of-Experts in the planner: FLOPs, weights and memory of the experts, the EP all-to-alls, the
simulator's --ep and the Megatron adapter's MoE flags. Numbers worked by hand on a tiny MoE shape."""
import argparse
import dataclasses
import json
import math

import numpy as np
import pytest

from dcp_megatron.planner.bounds import lower_bound
from dcp_megatron.planner.costmodel import CostModel, GpuCosts, MENU_NAMES, ModelShape, cluster_preset, model_preset
from dcp_megatron.planner.plan import NO_RECOMPUTE, SELECTIVE, Recompute
from dcp_megatron.simulate import SimulationConfig, main, simulate
from tests.support.planner_helpers import tiny_cluster

# 2 layers, hidden 8, 2 heads of 4 (1 KV head), plain (non-gated) MLPs, 4 experts of width 12, top-2.
TINY_MOE = ModelShape(num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4, ffn_hidden_size=16,
                      vocab_size=10, gated_mlp=False, num_experts=4, moe_topk=2, moe_ffn_hidden_size=12)


def test_tiny_moe_params_and_flops_by_hand():
    m = TINY_MOE
    assert m.attn_params_per_layer == 8 * (8 + 8) + 8 * 8                 # q, k, v in; output: 192
    assert m.expert_mlp_params == 2 * 8 * 12                               # one expert: 192
    assert m.router_params_per_layer == 8 * 4                              # 32
    assert m.mlp_params_per_layer == 32 + 4 * 192                          # every expert stored: 800
    assert m.active_mlp_params_per_layer == 32 + 2 * 192                   # router + top-2: 416
    assert m.linear_params == 2 * (192 + 800) + 8 * 10                     # 2064
    assert m.num_params == 2064 + 8 * 10 + (2 * 2 * 8 + 8)                 # + embedding, norms: 2184
    assert m.linear_flops_per_token == 6.0 * (2 * (192 + 416) + 8 * 10)    # top-2 experts, not all: 7776
    assert m.expert_params == 2 * 4 * 192                                  # 1536
    assert dataclasses.replace(m, ep=2).params_per_rank(m.num_params) == (2184 - 1536) + 1536 / 2   # 1416
    # the expert width defaults to the dense FFN width
    assert dataclasses.replace(m, moe_ffn_hidden_size=None).expert_mlp_params == 2 * 8 * 16


def test_tiny_moe_static_and_activation_memory_by_hand():
    cluster = tiny_cluster(4)
    sharded = CostModel(dataclasses.replace(TINY_MOE, ep=2), cluster, allowed_recompute=MENU_NAMES)
    # dense 648 params: 2 + 4 + 12/4 B; 2 of 4 experts (768 params): 2 + 4 + 12/(4/2) B (expert-DP of 2)
    assert sharded.static_bytes == 648 * 9 + 768 * 12
    whole = CostModel(dataclasses.replace(TINY_MOE, ep=2), dataclasses.replace(cluster, distributed_optimizer=False))
    assert whole.static_bytes == (648 + 768) * 18
    assert CostModel(TINY_MOE, cluster).static_bytes == 648 * 9 + 1536 * 9       # EP 1: every expert on the rank
    # FP8 weight copies: 2 B per linear weight held, experts / ep
    fp8 = CostModel(dataclasses.replace(TINY_MOE, ep=2), cluster, gpu=GpuCosts(fp8=True))
    assert fp8.static_bytes - sharded.static_bytes == 2 * ((2064 - 1536) + 768)
    # activations per layer (memory_spec.py, the TE spec, bf16): attention norm input 16 + 1/rms 4 and output 16,
    # q k v 2 x 16, output 16, LSE 4 B x 2 heads = 92; MoE: pre-MLP norm input 16 + 1/rms 4, router input 16, the
    # router's state (int64 map 8 x 4 experts, 20 B x top-2, the permuted probabilities 2 x 2 B) 76, top-2 copies
    # of the experts' input 2 x 16, fc1 output and activation output 2 x 2 B x 12 each = 240
    attention, moe_layer = 20 + 16 + 32 + 16 + 8, 20 + 16 + (8 * 4 + 20 * 2 + 2 * 2) + 2 * 16 + 48 + 48
    # the output layer: bf16 logits and their fp32 copy 6 x vocab 10; the final norm (16 + 4), its output and the
    # decoder's input (2 x 16), int64 labels and the fp32 loss
    output = 6 * 10 + (20 + 32 + 8 + 4)
    # a layer's backward: the experts' output gradient 2 B x top-2 x 8 and one expert's rows 2 x 2 x 3 x 12 / 4
    mlp_grad = 2 * 2 * (8 + 3 * 12 / 4)
    layer = attention + moe_layer
    assert sharded.bytes_per_local_token(NO_RECOMPUTE) == layer * 2 + output           # the loss's peak
    assert sharded.bytes_per_local_token(SELECTIVE) == (layer - 8) * 2 + output       # core_attn frees the LSE
    moe_act, moe = (Recompute("selective", modules=frozenset({m})) for m in ("moe_act", "moe"))
    assert sharded.bytes_per_local_token(moe_act) == (layer - 48) * 2 + output        # the activation's output
    # `moe` keeps the MoE layer's input only; the last layer's backward brings its experts back beside their
    # gradients: a higher peak than the loss's
    freed = 76 + 32 + 48 + 48
    assert sharded.bytes_per_local_token(moe) == (layer - freed) * 2 + freed + mlp_grad
    # full recompute of both layers: their inputs (2 x 16) rerun last, one of them whole beside its gradients
    assert sharded.bytes_per_local_token(Recompute("full", 2)) == 2 * 16 + layer + mlp_grad


def test_a_shared_expert_is_a_dense_mlp_every_token_runs_beside_its_experts():
    """--moe-shared-expert-intermediate-size 6 on TINY_MOE (plain MLPs): 2 x 8 x 6 = 96 weights a layer, stored and
    multiplied by every token, not split over EP; it keeps fc1's output and fc2's input (2 B x 6 each; its input is
    the router's, kept once), which `moe` recompute frees with the experts'; FP8 adds its own 1 B input copy."""
    from dcp_megatron.planner.costmodel.activations import layer_tensors
    from dcp_megatron.planner.costmodel.memory_spec import TRANSFORMER_ENGINE_FP8
    from dcp_megatron.planner.costmodel.param_sharding import largest_gathered_params

    shared = dataclasses.replace(TINY_MOE, moe_shared_expert_size=6)
    assert shared.shared_expert_params == 96
    assert shared.mlp_params_per_layer - TINY_MOE.mlp_params_per_layer == 96
    assert shared.linear_flops_per_token - TINY_MOE.linear_flops_per_token == 6.0 * 2 * 96
    assert shared.expert_params == TINY_MOE.expert_params          # not an EP-split expert
    assert largest_gathered_params(dataclasses.replace(shared, ep=2)) - \
        largest_gathered_params(dataclasses.replace(TINY_MOE, ep=2)) == 96
    added = {k: v for k, v in layer_tensors(shared).items() if k not in layer_tensors(TINY_MOE)}
    assert added == {"shared_fc1_out": 12, "shared_fc2_in": 12}
    cluster = tiny_cluster(4)
    moe = Recompute("selective", modules=frozenset({"moe"}))
    with_shared, without = (CostModel(m, cluster, allowed_recompute=MENU_NAMES) for m in (shared, TINY_MOE))
    assert with_shared.layer_bytes_per_local_token(moe) == without.layer_bytes_per_local_token(moe)
    assert with_shared.layer_bytes_per_local_token(NO_RECOMPUTE) - without.layer_bytes_per_local_token(NO_RECOMPUTE) \
        == 2 * 24
    assert layer_tensors(dataclasses.replace(shared, activations=TRANSFORMER_ENGINE_FP8))["shared_fc1_in"] == 8
    with pytest.raises(ValueError, match="needs experts"):
        dataclasses.replace(TINY_MOE, num_experts=None, moe_shared_expert_size=6)


def test_all_to_all_seconds_by_hand():
    """EP 2 on the tiny cluster (10 GB/s in a node, 1 us per collective): per local token, layer and pass
    8/1 x top-2 x 2 B x 1/2 = 16 B; 2 layers x (4 passes + 2 per recomputed layer)."""
    cluster = tiny_cluster(4)
    ep1, ep2 = CostModel(TINY_MOE, cluster), CostModel(dataclasses.replace(TINY_MOE, ep=2), cluster)
    per_pass = 100 * 16 / 1e10 + 1e-6
    for recompute, passes in ((NO_RECOMPUTE, 8), (SELECTIVE, 8), (Recompute("full", 1), 10), (Recompute("full", 2), 12)):
        added = ep2.microbatch_time([100], 1, recompute=recompute) - ep1.microbatch_time([100], 1, recompute=recompute)
        assert added == pytest.approx(passes * per_pass, rel=1e-9), recompute
    # CP 2: each rank dispatches its 50 local tokens
    assert (ep2.microbatch_time([100], 2) - ep1.microbatch_time([100], 2)) == pytest.approx(8 * (50 * 16 / 1e10 + 1e-6))


def test_all_to_all_is_zero_at_ep1_and_grows_with_ep():
    lengths = [32768, 4096, 700]
    cluster = cluster_preset("h200", domain_size=32)              # 8 ranks per node: EP 8 stays inside one
    mixtral = model_preset("mixtral-8x7b")
    ep1 = CostModel(mixtral, cluster)
    assert ep1.moe.seconds(1e6) == 0.0
    times = [CostModel(dataclasses.replace(mixtral, ep=ep), cluster).microbatch_time(lengths, 2) for ep in (1, 2, 4, 8)]
    assert times == sorted(times) and len(set(times)) == 4
    # EP 16 leaves the node: inter-node bandwidth, far more than the (15/16) / (7/8) volume ratio
    ep8 = CostModel(dataclasses.replace(mixtral, ep=8), cluster)
    ep16 = CostModel(dataclasses.replace(mixtral, ep=16, num_experts=16), cluster)
    assert ep16.moe.seconds_per_local_token > 5 * ep8.moe.seconds_per_local_token


def test_all_to_all_invariant_over_random_micro_batches():
    """For any micro-batch, CP size and recompute: EP adds exactly moe.seconds(local tokens, recomputed layers),
    the same at every first rank, and never less at a larger EP."""
    rng = np.random.default_rng(7)
    cluster = cluster_preset("h200", domain_size=16, gpus_per_node=4)
    costs = [CostModel(model_preset("mixtral-8x7b", tp=2, ep=ep), cluster) for ep in (1, 2, 4, 8)]
    for _ in range(40):
        lengths = rng.integers(1, 200_000, size=rng.integers(1, 6)).tolist()
        cp = int(rng.choice([1, 2, 4, 8, 16]))
        recompute = Recompute("full", int(rng.integers(1, 33))) if rng.random() < 0.5 else NO_RECOMPUTE
        first = int(rng.integers(0, 16 - cp + 1))
        local = float(sum(CostModel.padded(np.array(lengths), cp)) / cp)
        base = costs[0].microbatch_time(lengths, cp, first_rank=first, recompute=recompute)
        added = [c.microbatch_time(lengths, cp, first_rank=first, recompute=recompute) - base for c in costs[1:]]
        for cost, extra in zip(costs[1:], added):
            assert extra == pytest.approx(cost.moe.seconds(local, recompute.full_layers), rel=1e-9, abs=1e-12)
        assert added == sorted(added) and added[0] > 0


def test_moe_shape_and_cost_model_refuse_bad_values():
    for changes, field in (({"num_experts": -1}, "num_experts"), ({"moe_topk": 0}, "moe_topk"),
                           ({"moe_topk": 5}, "moe_topk"), ({"moe_ffn_hidden_size": 0}, "moe_ffn_hidden_size"),
                           ({"ep": 3}, "ep"), ({"num_experts": None, "ep": 2}, "ep")):
        with pytest.raises(ValueError, match=field):
            dataclasses.replace(TINY_MOE, **changes)
    with pytest.raises(ValueError, match="ep=4 does not divide the domain of 2"):
        CostModel(dataclasses.replace(TINY_MOE, ep=4), tiny_cluster(2))


def test_dense_presets_keep_their_numbers():
    """Pinned before MoE entered the cost model (same values at the commit before it). Memory is the TE spec's
    count (memory_spec.py): the stage's layers and the output layer at the loss's peak, which a layer's backward
    stays below here; PP 2's stage 0 holds 2 micro-batches' layers instead when that is more."""
    from dcp_megatron.planner.costmodel.activations import layer_tensors
    from dcp_megatron.planner.costmodel.memory_spec import spec_output_bytes

    expected = {
        "llama3-8b": (1, 1, 8030261248, 45027950592.0, 70824193024, 0.7658162336383516, 1.266326790096843),
        "llama3-70b": (8, 2, 70553706496, 417010286592.0, 40063171968, 0.32774941307385774, 0.46022274444189804),
        "gpt-tiny": (1, 1, 918656, 5111808.0, 1618517600, 0.004166926110470787, 0.006039865962926455),
    }
    for name, (tp, pp, params, flops, static, time_s, bound) in expected.items():
        model = model_preset(name, tp=tp, pp=pp)
        cost = CostModel(model, cluster_preset("h200", domain_size=16), gpu=GpuCosts(fp8=True, communicators=True))
        assert (model.num_params, model.linear_flops_per_token, cost.static_bytes) == (params, flops, static), name
        assert cost.microbatch_time([32768, 1000], 4, recompute=Recompute("full", 2)) == pytest.approx(time_s, rel=1e-12)
        layers = model.num_layers // pp * sum(layer_tensors(model).values())
        per_vocab, per_token = spec_output_bytes(model, model.activation_spec)
        peak = max(pp * layers, layers + per_vocab * model.vocab_size / tp + per_token)
        assert cost.microbatch_memory([32768], 2) == static + math.ceil(32768 / 2 * peak), name
        assert cost.max_local_tokens(NO_RECOMPUTE) == int((cost.cluster.mem_budget_bytes - static) // peak), name
        assert lower_bound([(0, 100000), (1, 5000), (2, 300)], cost) == pytest.approx(bound, rel=1e-12)


def test_mixtral_preset_counts():
    m = model_preset("mixtral-8x7b")
    assert m.num_params == pytest.approx(46.7e9, rel=0.01)          # Mixtral-8x7B: 46.7B parameters
    assert m.active_linear_params + m.hidden_size * m.vocab_size == pytest.approx(12.9e9, rel=0.02)   # 12.9B active


def test_lower_bound_charges_the_all_to_alls_and_stays_below_plans():
    from dcp_megatron.planner.policies import make_plan
    from dcp_megatron.planner.rescore import rescored
    from dcp_megatron.planner.timeline import plan_makespan

    cluster = cluster_preset("h200", domain_size=16, gpus_per_node=4)
    batch = [(i, n) for i, n in enumerate([60000, 9000, 4000, 2500, 1200, 800, 500, 300] * 4)]
    ep8 = CostModel(model_preset("mixtral-8x7b", tp=2, ep=8), cluster)
    zeroed = CostModel(model_preset("mixtral-8x7b", tp=2, ep=8), cluster)
    zeroed.moe = dataclasses.replace(zeroed.moe, seconds_per_local_token=0.0, latency_s=0.0)
    bound = lower_bound(batch, ep8)
    assert bound > lower_bound(batch, zeroed) * 1.05
    for policy in ("static", "megatron-dynamic", "dcp"):
        assert plan_makespan(rescored(make_plan(policy, batch, ep8, max_seq_len=60000), ep8)) >= bound


@pytest.fixture(scope="module")
def moe_runs():
    def run(model: str, cluster: str, gpus: int, tp: int, ep: int, tokens: int, max_seq_len: int | None, tune: bool):
        config = SimulationConfig(lengths="builtin:prolong", model=model, cluster=cluster, gpus=gpus, gpus_per_node=8,
                                  tp=tp, ep=ep, tokens_per_step=tokens, steps=2, seed=3, max_seq_len=max_seq_len,
                                  overlong="truncate", tune_baselines=tune)
        return simulate(config, keep_step=1)
    # the tiny runs plan the tuned baselines (their sweep's settings, in lockstep too); Mixtral's sweep alone would
    # take ~25 CPU s, so it plans them at their defaults
    return {"tiny ep2": run("gpt-tiny-moe", "cpu", 4, 1, 2, 8192, 2048, True),
            "tiny ep1": run("gpt-tiny-moe", "cpu", 4, 1, 1, 8192, 2048, True),
            "mixtral ep8": run("mixtral-8x7b", "h200", 16, 2, 8, 262144, None, False)}


def test_simulator_ep_plans_in_lockstep(moe_runs):
    for run in ("tiny ep2", "mixtral ep8"):
        result, kept = moe_runs[run]
        assert set(kept) == set(result.config.policies)
        for name, plan in kept.items():        # simulate() already validated every plan of every step
            assert all(len(g.microbatches) == 1 for wave in plan.waves for g in wave.groups), (run, name)
            counts = [sum(1 for wave in plan.waves for g in wave.groups if g.first_rank <= r < g.first_rank + g.size)
                      for r in range(plan.domain_size)]
            assert len(set(counts)) == 1, (run, name, counts)
        assert result.to_json()["config"]["ep"] == result.config.ep > 1
    # the premise: at EP 1 the same batch gets a group with several micro-batches in one wave
    _, kept_ep1 = moe_runs["tiny ep1"]
    assert any(len(g.microbatches) > 1 for plan in kept_ep1.values() for wave in plan.waves for g in wave.groups)


def test_simulator_ep_flag_is_validated(capsys, tmp_path):
    with pytest.raises(ValueError, match="--ep 3 does not divide the domain of 8"):
        SimulationConfig(lengths="builtin:prolong", gpus=8, ep=3)
    with pytest.raises(ValueError, match="--ep must be a positive integer"):
        SimulationConfig(lengths="builtin:prolong", gpus=8, ep=0)
    assert main(["--lengths", "builtin:prolong", "--model", "llama3-8b", "--gpus", "8", "--ep", "2", "--steps", "1"]) == 2
    assert "ep=2 needs experts" in capsys.readouterr().err
    out = tmp_path / "r.json"
    assert main(["--lengths", "builtin:lognormal", "--model", "mixtral-8x7b", "--gpus", "16", "--tp", "2", "--ep", "8",
                 "--steps", "1", "--tokens-per-step", "65536", "--policies", "static,dcp", "--json", str(out)]) == 0
    assert "ep=8" in capsys.readouterr().out and json.loads(out.read_text())["config"]["ep"] == 8


def test_megatron_adapter_passes_the_moe_flags():
    from dcp_megatron.core.planning import model_shape_from_args

    args = argparse.Namespace(
        num_layers=4, hidden_size=64, num_attention_heads=4, group_query_attention=False, num_query_groups=None,
        kv_channels=16, ffn_hidden_size=256, padded_vocab_size=512, swiglu=True, tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1, expert_model_parallel_size=2, num_experts=4, moe_router_topk=1,
        moe_ffn_hidden_size=None)
    shape = model_shape_from_args(args)
    assert (shape.num_experts, shape.moe_topk, shape.ep, shape.expert_mlp_params) == (4, 1, 2, 3 * 64 * 256)
    shape = model_shape_from_args(argparse.Namespace(**{**vars(args), "moe_ffn_hidden_size": 96}))
    assert shape.expert_mlp_params == 3 * 64 * 96
    shared = model_shape_from_args(argparse.Namespace(**{**vars(args), "moe_shared_expert_intermediate_size": 32}))
    assert shared.shared_expert_params == 3 * 64 * 32
    dense = model_shape_from_args(argparse.Namespace(**{**vars(args), "num_experts": None,
                                                         "moe_shared_expert_intermediate_size": 32}))
    assert not dense.is_moe and dense.ep == 1 and dense.linear_flops_per_token == 6.0 * dense.linear_params


def test_simulator_recompute_flag_limits_every_policy(tmp_path):
    """--recompute none,selective (what --dcp allows under EP > 1) reaches every policy's cost model: the tiny
    MoE's 2,048-token documents then run without full recompute; --recompute full makes every policy use it."""
    def kinds(recompute: str) -> set[str]:
        out = tmp_path / recompute.replace(",", "_")
        assert main(["--lengths", "builtin:prolong", "--model", "gpt-tiny-moe", "--cluster", "cpu", "--gpus", "4",
                     "--ep", "2", "--tokens-per-step", "8192", "--max-seq-len", "2048", "--overlong", "truncate",
                     "--steps", "2", "--seed", "3", "--recompute", recompute, "--dump-plans", str(out)]) == 0
        from dcp_megatron.planner.plan import StepPlan
        return {mb.recompute.kind for path in out.glob("*/step_*.json")
                for plan in [StepPlan.from_json(path.read_text())] for w in plan.waves for g in w.groups
                for mb in g.microbatches if mb.sequences}
    assert kinds("full") == {"full"}
    assert "full" not in kinds("none,selective")
    with pytest.raises(ValueError, match="--recompute: .*unknown recompute kind"):
        SimulationConfig(lengths="builtin:prolong", recompute=("none", "everything"))
