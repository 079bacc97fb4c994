"""The cost model: monotone where physics says so, memory accounting, comm placement, profiles."""
import dataclasses
import json

import pytest

from dcp_megatron.planner.costmodel.activations import layer_tensors
from dcp_megatron.planner.costmodel import CostModel, cluster_preset, load_profile, model_preset
from dcp_megatron.planner.plan import NO_RECOMPUTE, SELECTIVE, Recompute
from tests.support.planner_helpers import tiny_cluster, tiny_cost


@pytest.fixture(scope="module")
def llama():
    return CostModel(model_preset("llama3-8b"), cluster_preset("h200", domain_size=32))


def test_time_grows_with_tokens_and_attention_is_quadratic(llama):
    t = [llama.microbatch_time([n], 1) for n in (1024, 4096, 16384, 65536)]
    assert t == sorted(t)
    # many short documents are cheaper than one long one with the same tokens (causal attention ~ L²)
    assert llama.microbatch_time([1024] * 64, 1) < llama.microbatch_time([65536], 1)
    # a second document only adds time
    assert llama.microbatch_time([4096, 100], 1) > llama.microbatch_time([4096], 1)


def test_cp_divides_compute_but_pays_communication(llama):
    long_alone = [llama.microbatch_time([131072], c) for c in (1, 2, 4, 8)]
    assert long_alone == sorted(long_alone, reverse=True)          # long documents gain from CP
    # short documents: less than an 8x speedup on 8 ranks (padding, slow short kernels, K/V traffic)
    assert llama.microbatch_time([500] * 16, 8) > llama.microbatch_time([500] * 16, 1) / 8


def test_inter_node_groups_are_slower_than_intra_node():
    model = model_preset("llama3-8b")
    wide = CostModel(model, cluster_preset("h200", domain_size=16, gpus_per_node=8))
    narrow = CostModel(model, cluster_preset("h200", domain_size=16, gpus_per_node=4))
    lengths = [2048] * 8
    assert wide.cluster.same_node(0, 8) and not narrow.cluster.same_node(0, 8)
    assert narrow.microbatch_time(lengths, 8) > wide.microbatch_time(lengths, 8)
    # placement matters inside one cluster too: ranks 6..9 straddle two nodes
    assert wide.microbatch_time(lengths, 4, first_rank=6) > wide.microbatch_time(lengths, 4, first_rank=4)
    # a size-1 group never communicates
    assert narrow.microbatch_time(lengths, 1) == wide.microbatch_time(lengths, 1)


def test_memory_falls_with_cp_size_and_recompute(llama):
    mem = [llama.microbatch_memory([65536], c) for c in (1, 2, 4, 8)]
    assert mem == sorted(mem, reverse=True)
    assert llama.microbatch_memory([], 1) == llama.static_bytes
    none = llama.microbatch_memory([32768], 4)
    selective = llama.microbatch_memory([32768], 4, recompute=SELECTIVE)
    full = [llama.microbatch_memory([32768], 4, recompute=Recompute("full", k)) for k in range(2, 33)]
    assert selective < none and full[0] < none
    assert full == sorted(full, reverse=True)
    # full recompute costs time in proportion to the layers recomputed
    times = [llama.microbatch_time([32768], 4, recompute=Recompute("full", k)) for k in (1, 16, 32)]
    assert times == sorted(times) and times[0] > llama.microbatch_time([32768], 4)


def test_static_memory_follows_the_optimizer_setting():
    model = model_preset("llama3-8b")
    sharded = CostModel(model, cluster_preset("h200", domain_size=32))
    whole = CostModel(model, dataclasses.replace(cluster_preset("h200", domain_size=32), distributed_optimizer=False))
    assert whole.static_bytes - sharded.static_bytes == pytest.approx(model.num_params * 12 * (1 - 1 / 32), rel=1e-6)
    tp2 = CostModel(model_preset("llama3-8b", tp=2), cluster_preset("h200", domain_size=16))
    assert tp2.static_bytes < sharded.static_bytes


def test_best_recompute_is_the_fastest_that_fits(llama):
    assert llama.best_recompute([4096], 1) == NO_RECOMPUTE
    rc = llama.best_recompute([40000], 1)
    assert rc is not None and rc.kind == "full"
    assert llama.fits([40000], 1, recompute=rc)
    assert not llama.fits([40000], 1, recompute=Recompute("full", rc.full_layers - 1))
    assert llama.best_recompute([400000], 1) is None          # nothing fits on one rank
    assert llama.best_recompute([400000], 16) is not None


def test_pipeline_stage_time_and_recompute_depth():
    one = CostModel(model_preset("llama3-8b"), cluster_preset("h200", domain_size=8))
    four = CostModel(model_preset("llama3-8b", pp=4), cluster_preset("h200", domain_size=8))
    overhead = one.cluster.microbatch_overhead_s
    assert (four.microbatch_time([8192], 1) - overhead) == pytest.approx((one.microbatch_time([8192], 1) - overhead) / 4)
    assert four.layers_per_stage == 8
    assert four.recompute_options()[-1] == Recompute("full", 8)


def test_output_layer_counts_bf16_logits_and_their_fp32_upcast():
    """At the cross-entropy peak the last stage holds the output layer's bf16 logits (2 B) and the fp32 copy
    vocab_parallel_cross_entropy makes of them (4 B) per vocab/tp entry per local token; with PP > 1 stage 0's
    in-flight activations can be the larger term, as before. Beside them, per token: the final norm (TE: its input
    and 1/rms), its output and the decoder's input GPTModel holds (bf16), the int64 labels and the fp32 loss.
    Llama-3-8B: vocab 128,256, hidden 4,096, 32 layers."""
    h = 4096
    for tp in (1, 2):
        cost = CostModel(model_preset("llama3-8b", tp=tp), cluster_preset("h200", domain_size=8))
        layers = 32 * sum(layer_tensors(model_preset("llama3-8b", tp=tp)).values())
        per_token = (2 * h + 4 + 2 * 2 * h) / tp + 8 + 4
        assert cost.bytes_per_local_token(NO_RECOMPUTE) == layers + 6 * 128_256 / tp + per_token
        assert cost.held_bytes_per_local_token(NO_RECOMPUTE) == layers + 6 * 128_256 / tp + per_token
    measured = CostModel(model_preset("llama3-8b"), cluster_preset("h200", domain_size=8),
                         profile={"output_bytes_per_vocab": 4.0})   # a profile's factor holds all outside the layers
    layers = 32 * sum(layer_tensors(model_preset("llama3-8b")).values())
    assert measured.bytes_per_local_token(NO_RECOMPUTE) == layers + 4 * 128_256


def test_profile_overrides_constants(tmp_path):
    base = tiny_cost(4)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"gemm_flops": base.cluster.gemm_flops / 2, "inter_node_bw": 1e8, "meta": {"by": "t"}}))
    slow = CostModel(base.model, base.cluster, profile=load_profile(str(path)))
    assert slow.cluster.gemm_flops == base.cluster.gemm_flops / 2
    assert slow.microbatch_time([100], 1) > base.microbatch_time([100], 1)
    table = {"attention_times": [[1024, 1, 0.5], [4096, 1, 8.0], [4096, 2, 4.5]]}
    measured = CostModel(base.model, base.cluster, profile=table)
    gap = measured.microbatch_time([4096], 1) - measured.microbatch_time([4095], 1)
    assert measured.microbatch_time([4096], 1) > 8.0 > base.microbatch_time([4096], 1)
    assert gap < 0.1
    assert measured.microbatch_time([2048], 1) == pytest.approx(base.microbatch_time([2048], 1) - base.doc_terms([2048], 1)[2][0]
                                                                + 2.0, rel=1e-3)   # log-log midpoint of 0.5 and 8
    assert measured.microbatch_time([8192], 4) > measured.microbatch_time([8192], 8)


@pytest.mark.parametrize("bad, needle", [
    ({"gemm_flops": -1}, "gemm_flops"),
    ({"bandwidth": 3}, "unknown keys"),
    ({"attn_rate_points": [[0, 1e12]]}, "attn_rate_points"),
    ({"attention_times": [[1024, 1]]}, "attention_times"),
])
def test_bad_profiles_are_rejected(tmp_path, bad, needle):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=needle):
        load_profile(str(path))
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_profile(str(path))


def test_bad_arguments_raise_clear_errors():
    cost = tiny_cost(4)
    with pytest.raises(ValueError, match="cp_size"):
        cost.microbatch_time([10], 0)
    with pytest.raises(ValueError, match="positive"):
        cost.microbatch_memory([10, 0], 1)
    with pytest.raises(ValueError, match="ModelShape"):
        CostModel("llama3-8b", tiny_cluster(4))
    with pytest.raises(ValueError, match="unknown model preset"):
        model_preset("llama-9000")
    with pytest.raises(ValueError, match="domain_size"):
        cluster_preset("h200", domain_size=0)
    with pytest.raises(ValueError, match="collective_latency_s must be >= 0 seconds, got -1"):
        dataclasses.replace(tiny_cluster(4), collective_latency_s=-1.0)


def test_a_profiles_measured_factors_scale_the_spec_count_and_nothing_else_moves_the_peak():
    """A profile's factors per hidden unit replace the layers' count (none 70, a recomputed layer 8, its RoPE table
    among them) and its output factor everything outside the layers: without relief the peak is the loss's, the
    layers' saved bytes and the output, with no backward term left over from the unscaled spec."""
    from dcp_megatron.planner.costmodel import ModelShape, cpu_cluster

    shape = ModelShape(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, ffn_hidden_size=128,
                       vocab_size=256)
    profile = {"activation_bytes_per_hidden": {"none": 70.0, "selective": 66.0, "full": 8.0},
               "output_bytes_per_vocab": 5.0}
    cost = CostModel(shape, cpu_cluster(2), profile=profile)
    assert cost.bytes_per_local_token(NO_RECOMPUTE) == cost.held_bytes_per_local_token(NO_RECOMPUTE) == \
        2 * 70 * 64 + 5 * 256
    assert cost.layer_bytes_per_local_token(Recompute("full", 1)) == 70 * 64 + 8 * 64
