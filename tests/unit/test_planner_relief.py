"""Memory as megatron-core holds it (activations.py) and relief per micro-batch (relief.py)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dcp_megatron.planner.costmodel.activations import layer_tensors
from dcp_megatron.planner.costmodel import CostModel, ModelShape, cluster_preset, model_preset
from dcp_megatron.planner.plan import NO_RECOMPUTE, SELECTIVE, MicroBatch, Recompute
from dcp_megatron.planner.policies import make_plan
from dcp_megatron.planner.costmodel.relief import (MENU_NAMES, allows, held_bytes_per_layer, light_reliefs, menu_names,
                                         offloaded_bytes_per_layer)
from dcp_megatron.planner.validate import validate

MLP = Recompute("selective", modules=frozenset({"mlp"}))


def _h200(gpus=64, **kw):
    return CostModel(model_preset("llama3-8b", **kw), cluster_preset("h200", domain_size=gpus),
                     allowed_recompute=MENU_NAMES)


def test_llama_layer_bytes_by_tensor_and_what_each_module_frees():
    """Llama-3-8B, TP 1, TE spec (the presets' default): attention 4h (norm input + output) + 4 (1/rms) +
    2(q + 2kv) + 2q + LSE, MLP 4h + 4 + 2·2f + 2f."""
    m = model_preset("llama3-8b")
    t = layer_tensors(m)
    h, f, kv = 4096, 14336, 1024
    assert sum(t.values()) == 4 * h + 4 + 2 * (h + 2 * kv) + 2 * h + 4 * 32 + 4 * h + 4 + 6 * f
    cost = _h200()
    none = cost._layer_bytes[NO_RECOMPUTE]
    # MLP recompute under TE frees fc1's input, fc1's output and fc2's input: ~2/3 of the layer
    assert none - cost._layer_bytes[MLP] == 2 * h + 6 * f
    # core attention under TE's fused kernel keeps ~nothing of its own: the LSE only
    assert none - cost._layer_bytes[SELECTIVE] == 4 * 32
    # layernorm recompute is a no-op under TE (norms fused into the linears): not on the menu
    assert not any("layernorm" in r.modules for r in cost.recompute_options())
    local = CostModel(dataclasses.replace(m, transformer_impl="local"), cluster_preset("h200", domain_size=8),
                      allowed_recompute=MENU_NAMES)
    assert any(r.modules == {"layernorm"} for r in local.recompute_options())
    # TP 8 with sequence parallelism splits every tensor; without it the norms' tensors are whole
    assert sum(layer_tensors(model_preset("llama3-8b", tp=8)).values()) == pytest.approx(sum(t.values()) / 8)
    no_sp = dataclasses.replace(model_preset("llama3-8b", tp=8), sequence_parallel=False)
    assert layer_tensors(no_sp)["attn_norm_in"] == 2 * h + 4


def test_a_shape_is_counted_with_its_own_spec_else_its_transformer_impls():
    """A shape without a spec counts TE's for a TE run (v copied by TE's layout check: q + 2kv) and the local spec
    with our CPU attention for "local"; its own spec overrides either; the measured local spec keeps the whole qkv
    block through v's view."""
    from dcp_megatron.planner.costmodel.memory_spec import LOCAL_BF16, TRANSFORMER_ENGINE

    m = model_preset("llama3-8b")
    assert m.activation_spec == TRANSFORMER_ENGINE
    assert dataclasses.replace(m, transformer_impl="local").activation_spec == \
        dataclasses.replace(LOCAL_BF16, attention="cpu")
    te, local = layer_tensors(m), layer_tensors(dataclasses.replace(m, transformer_impl="local", activations=LOCAL_BF16))
    q, kv = 4096, 1024
    assert local["core_attn_in"] == 2 * (2 * q + 3 * kv) and te["core_attn_in"] == 2 * (q + 2 * kv)
    assert sum(layer_tensors(dataclasses.replace(m, activations=LOCAL_BF16)).values()) == sum(local.values())


def test_fp8_linears_keep_their_inputs_at_one_byte_and_linear_projs_its_own_copy():
    """Under --fp8-format TE's linears keep their input quantized (1 B): the norms' outputs linear_qkv and fc1
    read, fc2's input; linear_proj keeps a 1 B copy of the attention output beside the kernel's bf16 one; the
    experts' inputs likewise. Everything else is the bf16 TE count."""
    from dcp_megatron.planner.costmodel.memory_spec import TRANSFORMER_ENGINE_FP8

    m = model_preset("llama3-8b")
    h, f, q = 4096, 14336, 4096
    bf16, fp8 = layer_tensors(m), layer_tensors(dataclasses.replace(m, activations=TRANSFORMER_ENGINE_FP8))
    assert fp8["qkv_in"] == fp8["fc1_in"] == h and fp8["fc2_in"] == f and fp8["attn_out"] == 2 * q + q
    assert sum(bf16.values()) - sum(fp8.values()) == 2 * h + f - q
    moe = model_preset("mixtral-8x7b")
    moe_fp8 = layer_tensors(dataclasses.replace(moe, activations=TRANSFORMER_ENGINE_FP8))
    assert moe_fp8["expert_fc1_in"] == 2 * h and moe_fp8["expert_fc2_in"] == 2 * f     # top-2 copies, 1 B each
    with pytest.raises(ValueError, match="norm='te'"):
        dataclasses.replace(TRANSFORMER_ENGINE_FP8, norm="torch")


def test_a_long_document_gets_mlp_recompute_not_full_layers():
    """An attention-heavy micro-batch (a long document) that fits with MLP recompute takes it rather than the
    fewest full layers that fit (those rerun the attention too); the old menu had only full layers for it.
    A small overflow on a linear-heavy micro-batch takes a few full layers instead: the cheaper per micro-batch."""
    cost = _h200()
    local = cost.max_local_tokens(MLP) * 0.95
    assert local > 2 * cost.max_local_tokens(NO_RECOMPUTE)
    linear = local * cost._linear_s_per_token
    attn = 3.0 * linear
    chosen = cost.best_recompute_from_sums(local, linear + attn, attn, 8)
    assert chosen.kind == "selective" and "mlp" in chosen.modules, chosen
    legacy = CostModel(cost.model, cost.cluster)            # none, selective, full: a full-layer relief
    old = legacy.best_recompute_from_sums(local, linear + attn, attn, 8)
    assert old.kind == "full"
    assert (cost.time_from_sums(local, linear + attn, attn, 8, 0, chosen)
            < legacy.time_from_sums(local, linear + attn, attn, 8, 0, old))
    no_offload = CostModel(cost.model, cost.cluster, allowed_recompute=("none", "mlp", "full"))
    small = cost.max_local_tokens(NO_RECOMPUTE) * 1.05
    few = no_offload.best_recompute_from_sums(small, small * cost._linear_s_per_token, 0.0, 8)
    assert few.kind == "full" and few.full_layers < cost.layers_per_stage // 2, few


def test_plans_never_exceed_the_budget_under_the_corrected_count_on_a_document_that_needs_relief():
    cost = _h200(gpus=16)
    longest = 16 * cost.max_local_tokens(NO_RECOMPUTE) + 4096          # over what CP 16 holds without relief
    batch = [(0, longest)] + [(i, 3000 + 17 * i) for i in range(1, 120)]
    for policy in ("dcp", "megatron-dynamic", "static"):
        plan = make_plan(policy, batch, cost, max_seq_len=longest)
        validate(plan, batch, cost.cluster, cost)
        relieved = 0
        for wave in plan.waves:
            for g in wave.groups:
                for mb in g.microbatches:
                    assert cost.microbatch_memory(mb.lengths, g.size, recompute=mb.recompute) <= \
                        cost.cluster.mem_budget_bytes, (policy, mb.recompute)
                    relieved += mb.recompute != NO_RECOMPUTE
        assert relieved, policy


def test_offload_is_gpu_only_and_attn_proj_needs_core_attn():
    cpu = CostModel(model_preset("gpt-tiny"), cluster_preset("cpu", domain_size=2), allowed_recompute=MENU_NAMES)
    assert not any(r.offload for r in cpu.recompute_options())
    gpu = _h200()
    offloads = {r.offload for r in gpu.recompute_options() if r.offload}
    assert offloads and all("core_attn" in o for o in offloads)
    assert not any(r.offload & r.modules for r in gpu.recompute_options())


def test_core_attention_offload_copies_its_output_but_frees_only_q_k_v_and_the_lse():
    """megatron-core's core_attn group copies every tensor core attention saves (q, k, v, the LSE and the output)
    and frees q, k, v and the LSE; the output stays on the GPU as linear_proj's input unless attn_proj offloads it
    too. A stage keeps two layers' offloaded bytes on the GPU: megatron-core's margin and the layer in flight."""
    m = model_preset("llama3-8b")
    t = layer_tensors(m)
    core = Recompute("none", offload=frozenset({"core_attn"}))
    both = Recompute("none", offload=frozenset({"core_attn", "attn_proj"}))
    none = held_bytes_per_layer(m, NO_RECOMPUTE)
    assert none - held_bytes_per_layer(m, core) == pytest.approx(t["core_attn_in"] + t["attn_lse"])
    assert none - held_bytes_per_layer(m, both) == pytest.approx(t["core_attn_in"] + t["attn_lse"] + t["attn_out"])
    assert offloaded_bytes_per_layer(m, core) == offloaded_bytes_per_layer(m, both) == \
        pytest.approx(t["core_attn_in"] + t["attn_lse"] + t["attn_out"])
    cost = _h200()
    freed = none - held_bytes_per_layer(m, both)
    assert cost.layer_bytes_per_local_token(both) == pytest.approx(32 * none - 30 * freed)     # 32 layers, 2 kept


def test_offload_on_a_group_across_nodes_shares_the_host_link_with_the_nic():
    """Inter-node CP traffic reaches the GPU through the PCIe link the offload copies use: the same offload costs
    more on a group spanning two nodes than its copies alone would (what it adds over no offload, there vs on one
    node's worth of copies), and the array and scalar paths agree."""
    cost = _h200(gpus=32)
    off = Recompute("none", offload=frozenset({"core_attn"}))
    lengths = [16384]           # 1,024 tokens per rank: the inter-node K/V traffic outlasts the linear compute
    local, compute, attn = cost._sums(lengths, 16)
    added = {}
    for first_rank in (0, 4):    # CP 16 from rank 0 spans 2 nodes of 8; from rank 4, 3 nodes: both cross
        with_off = cost.time_from_sums(local, compute, attn, 16, first_rank, off)
        without = cost.time_from_sums(local, compute, attn, 16, first_rank, NO_RECOMPUTE)
        many = cost.times_from_sums(np.array([local]), np.array([compute]), np.array([attn]), 16,
                                    np.array([first_rank]), off)
        assert float(many[0]) == pytest.approx(with_off)
        added[first_rank] = with_off - without
    alone = float(cost._relief_costs.extra_seconds(local, compute, attn, off))   # the copies with an idle NIC
    assert added[0] > alone >= 0.0
    # one node (CP 8 from rank 0): no NIC traffic, the offload adds only its copies' own exposure
    local8, compute8, attn8 = cost._sums(lengths, 8)
    assert cost.time_from_sums(local8, compute8, attn8, 8, 0, off) - \
        cost.time_from_sums(local8, compute8, attn8, 8, 0, NO_RECOMPUTE) == \
        pytest.approx(float(cost._relief_costs.extra_seconds(local8, compute8, attn8, off)))


def test_menu_names_restrict_the_menu_and_selective_is_core_attn():
    assert menu_names(["full", "none"]) == ("none", "full")
    with pytest.raises(ValueError, match="unknown recompute kind"):
        menu_names(["everything"])
    assert allows(("none", "selective"), SELECTIVE) and allows(("core_attn",), SELECTIVE)
    assert not allows(("none", "selective", "full"), MLP)
    m = model_preset("llama3-8b")
    assert light_reliefs(m, ("none", "selective", "full"), can_offload=True) == [NO_RECOMPUTE, SELECTIVE]
    assert MLP in light_reliefs(m, ("none", "mlp"), can_offload=False)


def test_plan_json_keeps_old_plans_and_carries_modules_and_offload():
    assert Recompute.from_json("selective") == SELECTIVE and SELECTIVE.to_json() == "selective"
    assert Recompute.from_json({"full_layers": 3}) == Recompute("full", 3)
    both = Recompute("selective", modules=frozenset({"mlp"}), offload=frozenset({"core_attn"}))
    assert both.to_json() == {"modules": ["mlp"], "offload": ["core_attn"]}
    assert Recompute.from_json(both.to_json()) == both and str(both) == "mlp+offload(core_attn)"
    mb = MicroBatch(((0, 10),), both)
    assert MicroBatch.from_json(mb.to_json()) == mb
    with pytest.raises(ValueError):
        Recompute("full", 2, offload=frozenset({"core_attn"}))
    with pytest.raises(ValueError):
        Recompute.from_json({"modules": ["mlp"], "bogus": 1})


def test_dcp_seeded_with_a_baselines_layout_reliefs_each_microbatch():
    """megatron-dynamic pays its run-wide relief on every micro-batch; the relief pass gives the light ones none."""
    from dcp_megatron.planner.baselines.megatron_dynamic import plan_megatron_dynamic
    from dcp_megatron.planner.dcp.relief_pass import with_own_reliefs
    from dcp_megatron.planner.baselines.settings import DynamicSetting
    from dcp_megatron.planner.layout import check_batch

    cost = _h200(gpus=8)
    batch = [(i, 2000 + i) for i in range(64)]
    ids, lengths = check_batch(batch)
    waves = plan_megatron_dynamic(ids, lengths, cost, max_seq_len=4096,
                                  setting=DynamicSetting(token_cap=8192, recompute=MLP))
    assert {mb.recompute for w in waves for g in w.groups for mb in g.microbatches if mb.sequences} == {MLP}
    own, changed = with_own_reliefs(waves, cost)
    assert changed
    assert {mb.recompute for w in own for g in w.groups for mb in g.microbatches if mb.sequences} == {NO_RECOMPUTE}


def test_dcp_recompute_names_are_the_planners_menu():
    """--dcp-recompute (config.py, layer 0) spells the planner's menu names (relief.py) without importing it."""
    from dcp_megatron.config import DEFAULT_RECOMPUTE, RECOMPUTE_CHOICES
    assert RECOMPUTE_CHOICES == MENU_NAMES
    assert set(DEFAULT_RECOMPUTE) <= set(MENU_NAMES) and "offload" not in DEFAULT_RECOMPUTE


def test_our_cpu_attention_is_counted_per_cp_size_and_a_packer_without_one_gets_the_bound():
    """CP 1 keeps K/V repeated to every query head and the output twice; a CP group of c keeps its K/V gathered
    and their int64 row index (memory_spec.py). The GPU specs' count is the same for every group."""
    from dcp_megatron.planner.costmodel.memory_spec import CPU_FP32, LOCAL_BF16

    tiny = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, ffn_hidden_size=128,
                vocab_size=256, transformer_impl="local")
    cpu = CostModel(ModelShape(**tiny, activations=CPU_FP32),
                    cluster_preset("cpu", domain_size=4), allowed_recompute=MENU_NAMES)
    q, kv = 4 * 16, 2 * 16
    for c in (2, 4):     # per layer: the gathered K/V and index in place of the repeated K/V and the concatenation
        extra = 2 * (4 * c * 2 * kv + 8 * c - 3 * 4 * q)
        assert cpu.held_bytes_per_local_token(NO_RECOMPUTE, c) - cpu.held_bytes_per_local_token(NO_RECOMPUTE, 1) \
            == extra
    assert cpu.held_bytes_per_local_token(SELECTIVE, 4) == cpu.held_bytes_per_local_token(SELECTIVE, 1)
    # without a size: the larger of CP 1's and the largest group's (here CP 4 counts more)
    assert cpu.bytes_per_local_token(NO_RECOMPUTE) == cpu.bytes_per_local_token(NO_RECOMPUTE, 4)
    assert cpu.max_local_tokens(NO_RECOMPUTE) < cpu.max_local_tokens(NO_RECOMPUTE, 1)
    assert cpu.microbatch_memory([400], 2) < cpu.microbatch_memory([400], 1) / 2 + cpu.static_bytes / 2
    # a group that may run Ulysses (read: it attends as CP 1 does, on c times the rows with heads / c): at least CP 1
    ulysses = CostModel(ModelShape(**tiny, activations=CPU_FP32), cluster_preset("cpu", domain_size=4),
                        cp_attention=("ulysses",))
    assert ulysses.bytes_per_local_token(NO_RECOMPUTE, 2) == cpu.bytes_per_local_token(NO_RECOMPUTE, 1)
    gpu = CostModel(ModelShape(**tiny, activations=LOCAL_BF16), cluster_preset("cpu", domain_size=4))
    assert {gpu.bytes_per_local_token(NO_RECOMPUTE, c) for c in (None, 1, 2, 4)} == \
        {gpu.bytes_per_local_token(NO_RECOMPUTE)}
