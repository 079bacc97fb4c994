"""The cost model of multi-latent attention (q/k and v head dims differ, latents) and multi-token prediction layers."""
import argparse
import dataclasses

import pytest

from dcp_megatron.planner.costmodel.activations import layer_tensors
from dcp_megatron.planner.costmodel import CostModel, MlaShape, ModelShape, cluster_preset, model_preset
from dcp_megatron.planner.costmodel.memory_spec import LOCAL_BF16, TRANSFORMER_ENGINE
from dcp_megatron.planner.plan import NO_RECOMPUTE

HEADS, HIDDEN, LAYERS = 4, 128, 4
MLA = MlaShape(q_lora_rank=48, kv_lora_rank=32, qk_head_dim=32, qk_pos_emb_head_dim=16, v_head_dim=24)


def mla_model(mla: MlaShape = MLA, **changes) -> ModelShape:
    fields = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_heads=HEADS, num_kv_heads=HEADS, head_dim=32,
                  ffn_hidden_size=384, vocab_size=512, mla=mla)
    return ModelShape(**{**fields, **changes})


def with_mla(**changes) -> ModelShape:
    return mla_model(dataclasses.replace(MLA, **changes))


def test_attention_flops_use_the_qk_head_dim_for_scores_and_the_v_head_dim_for_pv():
    """Scores contract over qk_head_dim + qk_pos_emb_head_dim, PV over v_head_dim: 2·L²·d each per head, halved
    by causality, x3 with backward (our CPU attention runs v unpadded). Taking v's dim for q/k (or the reverse)
    moves these differences."""
    base = mla_model(transformer_impl="local").attn_flops_per_len2
    for change in ("v_head_dim", "qk_pos_emb_head_dim", "qk_head_dim"):
        wider = mla_model(dataclasses.replace(MLA, **{change: getattr(MLA, change) + 8}), transformer_impl="local")
        assert wider.attn_flops_per_len2 - base == 3 * LAYERS * HEADS * 8, change
    # the plain model's head_dim plays no part once MLA sets the dims
    assert mla_model(head_dim=64, transformer_impl="local").attn_flops_per_len2 == base


def test_the_gpu_kernel_runs_mla_values_padded_to_the_qk_head_dim():
    """megatron-core pads THD values to the q/k head dim before the kernel: PV runs at d_qk there, so a wider v
    changes no attention FLOPs and a wider rope part changes both products."""
    base = mla_model().attn_flops_per_len2
    assert with_mla(v_head_dim=MLA.v_head_dim + 8).attn_flops_per_len2 == base
    assert with_mla(qk_pos_emb_head_dim=MLA.qk_pos_emb_head_dim + 8).attn_flops_per_len2 - base \
        == 6 * LAYERS * HEADS * 8


def test_mla_weights_are_its_down_and_up_projections():
    """Per layer: q down (h x q_lora) and up (q_lora x heads·q/k dim), kv down (h x kv_lora + rope dim), kv up
    (kv_lora x heads·(qk + v)), output (heads·v x h): each dim moves exactly its matrices' weights."""
    base = mla_model().attn_params_per_layer
    assert with_mla(v_head_dim=MLA.v_head_dim + 1).attn_params_per_layer - base \
        == MLA.kv_lora_rank * HEADS + HEADS * HIDDEN
    assert with_mla(qk_pos_emb_head_dim=MLA.qk_pos_emb_head_dim + 1).attn_params_per_layer - base \
        == MLA.q_lora_rank * HEADS + HIDDEN
    assert with_mla(kv_lora_rank=MLA.kv_lora_rank + 1).attn_params_per_layer - base \
        == HIDDEN + HEADS * (MLA.qk_head_dim + MLA.v_head_dim)
    assert with_mla(q_lora_rank=None).attn_params_per_layer - base \
        == HIDDEN * HEADS * MLA.q_head_dim - (HIDDEN + HEADS * MLA.q_head_dim) * MLA.q_lora_rank
    # linear FLOPs follow the weights (6 per weight per token)
    wider = with_mla(v_head_dim=MLA.v_head_dim + 1)
    assert wider.linear_flops_per_token - mla_model().linear_flops_per_token \
        == 6 * LAYERS * (MLA.kv_lora_rank * HEADS + HEADS * HIDDEN)


CPU_TABLE = dict(transformer_impl="local")         # our CPU attention: values unpadded
CPU_SPEC = dict(activations=dataclasses.replace(LOCAL_BF16, attention="cpu"))


@pytest.mark.parametrize("kind", [CPU_TABLE, CPU_SPEC], ids=["table", "cpu-spec"])
def test_mla_saved_tensors_keep_v_at_its_own_head_dim(kind):
    """Core attention keeps q and k at the q/k head dim and v and the output at v's: one more v dim adds one
    value per head to the kept k/v and to the output; one more rope dim adds to q and k only."""
    base = layer_tensors(mla_model(**kind))
    d = 2
    wider_v = layer_tensors(mla_model(dataclasses.replace(MLA, v_head_dim=MLA.v_head_dim + 1), **kind))
    wider_qk = layer_tensors(mla_model(dataclasses.replace(MLA, qk_pos_emb_head_dim=MLA.qk_pos_emb_head_dim + 1),
                                       **kind))
    kv = "attn_kv_copy"          # our attention's own K/V copy
    assert wider_v[kv] - base[kv] == d * HEADS and wider_qk[kv] - base[kv] == d * HEADS
    assert wider_v["attn_out"] > base["attn_out"] and wider_qk["attn_out"] == base["attn_out"]


@pytest.mark.parametrize("spec", [None, LOCAL_BF16, TRANSFORMER_ENGINE], ids=["te-table", "local-bf16", "te"])
def test_mla_gpu_kernel_keeps_padded_values_and_linear_proj_a_trimmed_copy(spec):
    """On the GPU path the kernel keeps q, k and v all at the q/k head dim (v zero-padded) and its output at that
    width too; linear_proj keeps the output trimmed to v's dim, a copy (measured on the meta stack, exact)."""
    d, base = 2, layer_tensors(mla_model(activations=spec))
    wider_v = layer_tensors(mla_model(dataclasses.replace(MLA, v_head_dim=MLA.v_head_dim + 1), activations=spec))
    assert wider_v["core_attn_in"] == base["core_attn_in"]
    assert wider_v["attn_out"] - base["attn_out"] == d * HEADS          # the trimmed copy only
    wider_qk = layer_tensors(mla_model(dataclasses.replace(MLA, qk_pos_emb_head_dim=MLA.qk_pos_emb_head_dim + 1),
                                       activations=spec))
    assert wider_qk["attn_out"] - base["attn_out"] == d * HEADS          # the kernel's padded output
    # q, k and the padded v (v is a copy, not a view of a whole qkv block)
    assert wider_qk["core_attn_in"] - base["core_attn_in"] == 3 * d * HEADS
    # the latents: the kv down projection's output (latent and rope key part) and the q latent
    assert base["mla_kv_latent"] == d * (MLA.kv_lora_rank + MLA.qk_pos_emb_head_dim)
    assert base["mla_q_latent"] == d * MLA.q_lora_rank
    assert "mla_q_latent" not in layer_tensors(mla_model(dataclasses.replace(MLA, q_lora_rank=None), activations=spec))


def test_qk_layernorm_keeps_each_latents_norm_instead_of_the_latent():
    """The local spec's torch norm upcasts: its fp32 input and output and 1/rms (8w + 4), and the bf16 output the
    up projection keeps, in place of the latent (measured on the meta stack, exact)."""
    normed = layer_tensors(mla_model(dataclasses.replace(MLA, qk_layernorm=True), activations=LOCAL_BF16))
    assert normed["mla_q_latent"] == 8 * MLA.q_lora_rank + 4 + 2 * MLA.q_lora_rank
    assert normed["mla_kv_latent"] == 8 * MLA.kv_lora_rank + 4 + 2 * MLA.kv_lora_rank


def test_mla_moves_keys_and_values_at_their_own_head_dims_under_cp():
    """The CP all-gather moves each head's key (q/k dim) and value (v dim, unpadded by our attention)."""
    cluster = cluster_preset("h200", domain_size=8)
    narrow = CostModel(mla_model(transformer_impl="local"), cluster)
    wide = CostModel(mla_model(dataclasses.replace(MLA, v_head_dim=4 * MLA.v_head_dim), transformer_impl="local"),
                     cluster)
    assert wide.time._kv_bytes_per_token - narrow.time._kv_bytes_per_token \
        == HEADS * 3 * MLA.v_head_dim * 2 * LAYERS


def test_mla_needs_a_key_and_value_per_head():
    with pytest.raises(ValueError, match="num_kv_heads"):
        mla_model(num_kv_heads=2)
    with pytest.raises(ValueError, match="v_head_dim"):
        MlaShape(kv_lora_rank=32, qk_head_dim=32, qk_pos_emb_head_dim=16, v_head_dim=0)


def test_an_mtp_layer_adds_a_layer_its_projection_and_the_output_layer_once_more():
    dense, mtp = mla_model(), mla_model(mtp_num_layers=1)
    layer = dense.attn_params_per_layer + dense.active_mlp_params_per_layer
    assert mtp.linear_flops_per_token - dense.linear_flops_per_token \
        == 6 * (layer + 2 * HIDDEN * HIDDEN + HIDDEN * dense.vocab_size)
    assert mtp.attn_flops_per_len2 * LAYERS == dense.attn_flops_per_len2 * (LAYERS + 1)
    # stored weights: the layer and its projection and three norms; the output layer is shared
    assert mtp.num_params - dense.num_params == layer + 2 * HIDDEN * HIDDEN + 5 * HIDDEN


def test_an_mtp_layer_counts_its_experts():
    moe = dict(num_experts=4, moe_topk=2)
    assert mla_model(mtp_num_layers=1, **moe).expert_params * LAYERS == mla_model(**moe).expert_params * (LAYERS + 1)


@pytest.mark.parametrize("spec", [None, LOCAL_BF16], ids=["table", "local-bf16"])
def test_an_mtp_layer_adds_its_activations_and_logits_to_the_peak(spec):
    """The last stage holds the MTP layer's tensors and its logits beside the main loss's: at least one layer's
    saved bytes and the logits' more per local token."""
    cluster = cluster_preset("h200", domain_size=8)
    plain = CostModel(mla_model(activations=spec), cluster)
    mtp = CostModel(mla_model(activations=spec, mtp_num_layers=1), cluster)
    layer = sum(layer_tensors(mla_model(activations=spec)).values())
    added = mtp.bytes_per_local_token(NO_RECOMPUTE) - plain.bytes_per_local_token(NO_RECOMPUTE)
    assert added >= layer + 2 * 512   # a layer and bf16 logits over the vocabulary at least
    assert mtp.max_local_tokens(NO_RECOMPUTE) < plain.max_local_tokens(NO_RECOMPUTE)


def test_megatron_adapter_passes_the_mla_and_mtp_flags():
    from dcp_megatron.core.planning import model_shape_from_args

    args = argparse.Namespace(
        num_layers=4, hidden_size=64, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
        kv_channels=16, ffn_hidden_size=256, padded_vocab_size=512, swiglu=True, tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1, num_experts=None, multi_latent_attention=True, q_lora_rank=None,
        kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12, qk_layernorm=True, mtp_num_layers=1)
    shape = model_shape_from_args(args)
    assert shape.mla == MlaShape(kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12,
                                 qk_layernorm=True)
    assert (shape.num_kv_heads, shape.score_head_dim, shape.value_head_dim, shape.mtp_num_layers) == (4, 24, 12, 1)
    plain = model_shape_from_args(argparse.Namespace(**{**vars(args), "multi_latent_attention": False,
                                                        "mtp_num_layers": None}))
    assert (plain.mla, plain.num_kv_heads, plain.mtp_num_layers) == (None, 2, 0)


def test_the_deepseek_v3_like_preset_plans_a_long_document_with_ep():
    """MLA + 256 experts top-8 and a shared expert + MTP fits the H200 preset at EP 64: a 32K-token document has a
    CP group."""
    from dcp_megatron.planner.policies import make_plan

    model = model_preset("deepseek-v3-like", ep=64)
    assert model.mla is not None and model.num_experts == 256 and model.moe_topk == 8 and model.mtp_num_layers == 1
    assert model.moe_shared_expert_size == 2048
    cost = CostModel(model, cluster_preset("h200", domain_size=64))
    assert cost.max_local_tokens(NO_RECOMPUTE) > 0
    plan = make_plan("dcp", [(0, 32768), (1, 1024)], cost, max_seq_len=32768)
    assert plan.domain_size == 64
