"""The one carrier of a micro-batch's facts (dcp_megatron/core/microbatch_facts.py) reaches every reader: the
batch-dict seams of `get_batch` (patches/core_utils.py), the model (patches/models_gpt_gpt_model.py), attention's
recompute pin (patches/transformer_attention.py), the MoE router (patches/transformer_transformer_layer.py), our
core attention's shard and flavour (core/core_attention.py) and the DeepSpeed script's params; without the
carrier each reader keeps upstream's behaviour. One spawned rank serves every check."""
from __future__ import annotations

import argparse

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.support.dist_utils import run_distributed  # noqa: E402


def _documents():
    return [torch.tensor([[5, 6, 1]] * 3), torch.tensor([[7, 8, 1]] * 5)]


def _carrier_worker(rank: int, world_size: int) -> dict:
    from megatron.core import parallel_state
    from megatron.core import utils as core_utils
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.num_microbatches_calculator import (destroy_num_microbatches_calculator,
                                                           init_num_microbatches_calculator)
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.training import global_vars

    from dcp_megatron.core.microbatch_facts import MICROBATCH_KEY, facts_of
    from dcp_megatron.core.microbatches import build_batch
    from dcp_megatron.planner.plan import NO_RECOMPUTE, SELECTIVE
    from dcp_megatron.training.forward_step import DcpForwardStep
    from patches.megatron_set import megatron_patch_registry

    out: dict = {}
    with megatron_patch_registry():
        parallel_state.initialize_model_parallel()
        init_num_microbatches_calculator(0, None, 2, 1, 1)
        global_vars._GLOBAL_ARGS = argparse.Namespace(dcp=True)   # the MoE patch acts in --dcp runs only
        model_parallel_cuda_manual_seed(1)
        config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                                   hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
                                   num_moe_experts=4, moe_router_topk=2, moe_router_load_balancing_type="none",
                                   moe_token_dispatcher_type="alltoall", calculate_per_token_loss=True)
        model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=4),
                         vocab_size=64, max_sequence_length=32, position_embedding_type="rope")
        layer = model.decoder.layers[0]
        seen: list[dict] = []

        def at_decoder(module, args, kwargs):
            params = kwargs["packed_seq_params"]
            seen.append({"decoder_facts": facts_of(params), "local_cp_size": params.local_cp_size})

        def at_core_attention(module, args, kwargs):
            seen[-1]["attention_facts"] = facts_of(kwargs["packed_seq_params"])
            seen[-1]["checkpoint_core_attention"] = layer.self_attention.checkpoint_core_attention

        def at_router(module, args):
            seen[-1]["router_documents"] = getattr(module, "dcp_documents", None)

        model.decoder.register_forward_pre_hook(at_decoder, with_kwargs=True)
        layer.self_attention.core_attention.register_forward_pre_hook(at_core_attention, with_kwargs=True)
        layer.mlp.router.register_forward_pre_hook(at_router)

        def user_step(data_iterator, model, *, tp_rank_zero: bool):
            """Megatron-LM's get_batch and forward step, as on a middle pipeline stage (params without the
            micro-batch's CP size and group); on TP ranks > 0 get_batch reads no iterator and starts from {}."""
            batch = next(data_iterator) if tp_rank_zero else {}
            if tp_rank_zero:
                seen.append({"tp_batch": None})
            else:
                batch = core_utils.get_batch_on_this_tp_rank(batch)
                seen.append({"tp_batch": batch.get(MICROBATCH_KEY)})
            batch = core_utils.flatten_batch_for_packed_sequences(batch)
            bounds = batch["cu_seqlens_padded"].view(-1)
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds,
                                     cu_seqlens_q_padded=bounds, cu_seqlens_kv_padded=bounds,
                                     max_seqlen_q=int(batch["max_seqlen"].max()),
                                     max_seqlen_kv=int(batch["max_seqlen"].max()))
            # the module switch says the opposite of the micro-batch's own choice (as in a 1F1B replay's backward,
            # which runs after later micro-batches' forwards set it): the pin must read the micro-batch's facts
            facts = batch[MICROBATCH_KEY]
            for each in model.decoder.layers:
                each.self_attention.checkpoint_core_attention = facts.recompute.kind != "selective"
            output = model(batch["tokens"], batch["position_ids"], None, packed_seq_params=params)
            return output, None

        batches = [build_batch(_documents(), cp_size=1, cp_rank=0, group=None, recompute=recompute, wave_index=w,
                               device="cpu", microbatch_index=w)
                   for w, recompute in enumerate((SELECTIVE, NO_RECOMPUTE))]
        step = DcpForwardStep(lambda it, m: user_step(it, m, tp_rank_zero=False), batches, model_chunks=[model],
                              config=config)
        for _ in batches:
            step(iter([]), model)
        ran = seen[-4:-2], seen[-2:]
        out["dcp"] = [{**a, **b} for a, b in ran]
        out["facts"] = [b[MICROBATCH_KEY] for b in batches]
        # the same micro-batches outside DcpForwardStep: nothing attaches their facts to the params
        seen.clear()
        for batch in batches:
            user_step(iter([batch]), model, tp_rank_zero=True)
        out["bare"] = [{**seen[i], **seen[i + 1]} for i in (0, 2)]
        global_vars._GLOBAL_ARGS = None
        destroy_num_microbatches_calculator()
        parallel_state.destroy_model_parallel()
    out["cp_seam"] = _cp_rank_seam()
    out["core_attention"] = _core_attention_reads_the_facts()
    out["deepspeed"] = _deepspeed_params_carry_the_facts()
    # the worker's objects do not cross the report queue: identities are compared here
    facts = out.pop("facts")
    return {
        "dcp": [{"tp_batch_facts": row["tp_batch"] is fact, "decoder_facts": row["decoder_facts"] is fact,
                 "attention_facts": row["attention_facts"] is fact,
                 "router_documents": row["router_documents"] is fact.router_documents,
                 "local_cp_size": row["local_cp_size"], "checkpoint_core_attention": row["checkpoint_core_attention"]}
                for row, fact in zip(out["dcp"], facts)],
        "recompute": [str(fact.recompute) for fact in facts],
        "bare": [{"no_facts": row["decoder_facts"] is None and row["attention_facts"] is None,
                  "no_documents": row["router_documents"] is None, "local_cp_size": row["local_cp_size"],
                  "checkpoint_core_attention": row["checkpoint_core_attention"]} for row in out["bare"]],
        **{key: out[key] for key in ("cp_seam", "core_attention", "deepspeed")},
    }


def _cp_rank_seam() -> dict:
    """get_batch_on_this_cp_rank gives a DCP batch its facts' group as hybrid_cp_group (the batch-dict road)."""
    from megatron.core import utils as core_utils

    from dcp_megatron.planner.plan import NO_RECOMPUTE
    from dcp_megatron.core.microbatches import build_batch
    from patches.megatron_set import megatron_patch_registry

    group = object()
    with megatron_patch_registry():
        batch = build_batch(_documents(), cp_size=2, cp_rank=1, group=group, recompute=NO_RECOMPUTE, wave_index=0,
                            device="cpu")
        given = core_utils.get_batch_on_this_cp_rank(batch)
    return {"hybrid_cp_group_is_the_facts_group": given["hybrid_cp_group"] is group}


def _core_attention_reads_the_facts() -> dict:
    """PackedCoreAttention's CP flavour and shard come from the facts on its params; params without facts get the
    all-gather flavour and a shard rebuilt from their bounds."""
    import dataclasses

    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from dcp_megatron.core import core_attention
    from dcp_megatron.core.microbatch_facts import MICROBATCH_KEY, attach_facts
    from dcp_megatron.core.microbatches import build_batch
    from dcp_megatron.planner.plan import NO_RECOMPUTE

    class Pair:   # rank 1 of a CP group of 2 (cp_attention itself is replaced below)
        def size(self):
            return 2

        def rank(self):
            return 1

    pair, calls = Pair(), []
    batch = build_batch(_documents(), cp_size=2, cp_rank=1, group=pair, recompute=NO_RECOMPUTE, wave_index=0,
                        device="cpu", attention="ulysses")
    facts = batch[MICROBATCH_KEY]
    bounds = batch["cu_seqlens_padded"].view(-1)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, cu_seqlens_q_padded=bounds,
                             cu_seqlens_kv_padded=bounds, max_seqlen_q=8, max_seqlen_kv=8, local_cp_size=2,
                             cp_group=pair)
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                               attention_dropout=0.0)
    attention = core_attention.PackedCoreAttention(config, 1, AttnMaskType.causal, "self")
    rows = batch["tokens"].shape[1]
    qkv = torch.randn(rows, 4, 8)
    original = core_attention.cp_attention

    def recording(q, k, v, shard, group, *, softmax_scale, impl):
        calls.append((shard, group, impl))
        return torch.zeros_like(q)

    core_attention.cp_attention = recording
    try:
        attention(qkv, qkv, qkv, None, packed_seq_params=attach_facts(params, facts))
        attention(qkv, qkv, qkv, None, packed_seq_params=params)        # a second layer: the same shard
        attention(qkv, qkv, qkv, None, packed_seq_params=dataclasses.replace(params))   # no facts
    finally:
        core_attention.cp_attention = original
    (first, group, impl), (second, _, _), (bare, _, bare_impl) = calls
    return {"impl": impl, "bare_impl": bare_impl, "group": group is pair,
            "shard_is_the_facts": first is facts.attention_shard and second is first,
            "bare_shard_rebuilt": bare is not first and torch.equal(bare.token_index, first.token_index)}


def _deepspeed_params_carry_the_facts() -> dict:
    """The DeepSpeed script's forward_loss attaches the micro-batch's facts to the params it builds."""
    from pretrain_scripts.pretrain_gpt_deepspeed import forward_loss

    from dcp_megatron.core.microbatch_facts import MICROBATCH_KEY, facts_of
    from dcp_megatron.core.microbatches import build_batch
    from dcp_megatron.planner.plan import NO_RECOMPUTE

    batch = build_batch(_documents(), cp_size=1, cp_rank=0, group=None, recompute=NO_RECOMPUTE, wave_index=0,
                        device="cpu")
    received = []

    def engine(tokens, position_ids, attention_mask, *, labels, packed_seq_params):
        received.append(packed_seq_params)
        return torch.zeros(labels.shape)

    forward_loss(engine, batch)
    return {"facts_on_params": facts_of(received[0]) is batch[MICROBATCH_KEY]}


def test_the_microbatch_facts_reach_every_reader_and_without_them_upstream_runs():
    result = run_distributed(_carrier_worker, 1)[0]
    assert result["recompute"] == ["selective", "none"]
    # Per micro-batch: TP ranks > 0 got the running micro-batch for get_batch's empty dict; the decoder got params
    # carrying its facts, completed by the middle-stage patch (CP size 1); attention and the router read the same
    # facts; the recompute pin is the micro-batch's own choice, whatever the module switch said.
    assert result["dcp"] == [{"tp_batch_facts": True, "decoder_facts": True, "attention_facts": True,
                              "router_documents": True, "local_cp_size": 1, "checkpoint_core_attention": pinned}
                             for pinned in (True, False)], result["dcp"]
    # Outside DcpForwardStep nothing carries facts: params stay as built, the module switch rules, no documents.
    assert result["bare"] == [{"no_facts": True, "no_documents": True, "local_cp_size": None,
                               "checkpoint_core_attention": switch} for switch in (False, True)], result["bare"]
    assert result["cp_seam"] == {"hybrid_cp_group_is_the_facts_group": True}
    assert result["core_attention"] == {"impl": "ulysses", "bare_impl": "allgather", "group": True,
                                        "shard_is_the_facts": True, "bare_shard_rebuilt": True}
    assert result["deepspeed"] == {"facts_on_params": True}


def test_params_belong_to_one_microbatch():
    from megatron.core.packed_seq_params import PackedSeqParams

    from dcp_megatron.core.microbatch_facts import MICROBATCH_KEY, MicroBatchFacts, attach_facts, facts_of
    from dcp_megatron.core.microbatches import build_batch
    from dcp_megatron.planner.plan import NO_RECOMPUTE, SELECTIVE

    first, second = (build_batch(_documents(), cp_size=1, cp_rank=0, group=None, recompute=r, wave_index=0,
                                 device="cpu")[MICROBATCH_KEY] for r in (SELECTIVE, NO_RECOMPUTE))
    assert isinstance(first, MicroBatchFacts) and first.recompute_modules == {"core_attn"}
    assert second.recompute_modules == frozenset() and first.attention_shard is None   # CP size 1: no shard
    params = PackedSeqParams(qkv_format="thd")
    assert facts_of(params) is None and facts_of(None) is None
    assert facts_of(attach_facts(params, first)) is first
    attach_facts(params, first)   # the same micro-batch again (a second model call): fine
    with pytest.raises(RuntimeError, match="already belong to another DCP micro-batch"):
        attach_facts(params, second)
    with pytest.raises(TypeError, match="MicroBatchFacts"):
        attach_facts(PackedSeqParams(), {"recompute": SELECTIVE})
