"""Under --dcp an MoE router's balancing and z losses are per document (dcp_megatron/core/moe_aux.py), checked
against upstream's own router run on each document alone, on one process."""
from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.support.dist_utils import run_distributed  # noqa: E402

HIDDEN = 16
LENGTHS = (5, 9, 3)          # padded to 8, 12, 4 on a CP-2 group: 5 of the 24 rows are padding
ROW_MULTIPLE = 16            # 12 local rows -> a filler document of 4 local rows per rank
METRICS = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}


def _router_worker(rank: int, world_size: int, kind: str) -> dict:
    """One MoE layer's router gradient and logged metrics, two ways:
    - reference (each rank alike, no group): upstream's unpatched path on each document alone as its own
      micro-batch, per-token weighting, gradients summed over the documents;
    - DCP: one micro-batch of the three documents zig-zag sharded over a CP group of both ranks, with its
      padding and a filler document, through the patched layer (gradients summed over the two ranks);
    - DCP at TP 2 with sequence parallelism (same router weight): one CP-1 micro-batch of the three documents
      on both ranks, each TP rank routing its half of the rows (the documents' token counts summed over TP).
    Padding and filler rows carry hidden states of their own (not zeros), so counting them would show."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.num_microbatches_calculator import (destroy_num_microbatches_calculator,
                                                           init_num_microbatches_calculator)
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker, get_moe_metrics_tracker
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from megatron.training import global_vars

    from dcp_megatron.core.microbatch_facts import MICROBATCH_KEY, attach_facts
    from dcp_megatron.core.microbatches import build_batch
    from patches.megatron_set import megatron_patch_registry
    from dcp_megatron.planner.plan import NO_RECOMPUTE

    with megatron_patch_registry():
        parallel_state.initialize_model_parallel()
        model_parallel_cuda_manual_seed(1)
        init_num_microbatches_calculator(0, None, 4, 1, world_size)   # 2 micro-batches per rank in Megatron's count
        torch.manual_seed(0)
        config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2,
                                   use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                                   add_bias_linear=False, num_moe_experts=4, moe_router_topk=2,
                                   moe_aux_loss_coeff=0.5, moe_router_load_balancing_type=kind,
                                   moe_z_loss_coeff=0.1, moe_token_dispatcher_type="alltoall",
                                   calculate_per_token_loss=True)
        layer = TransformerLayer(config, get_gpt_layer_local_spec(num_experts=4).submodules, layer_number=1)
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
        tracker = get_moe_metrics_tracker()
        router = layer.mlp.router
        total = sum(LENGTHS)
        # row 0: what padding and filler rows hold; row 1 + i: the i-th real token (documents back to back)
        table = torch.randn(total + 1, HIDDEN)

        def run(rows, packed_seq_params, layer=layer):
            layer.zero_grad(set_to_none=True)
            tracker.clear()
            output = layer._forward_mlp(rows, padding_mask=None, packed_seq_params=packed_seq_params)
            (output * 0).sum().backward()   # only the balancing and z losses reach the router weight
            metrics = {name: float(entry.values.sum()) for name, entry in tracker.metrics.items()}
            return layer.mlp.router.weight.grad.clone(), metrics

        # reference: each document alone, upstream's path (no packed params: not a DCP micro-batch)
        reference_grad, reference_metrics, start = torch.zeros_like(router.weight), {}, 1
        for length in LENGTHS:
            grad, metrics = run(table[start:start + length].unsqueeze(1), None)
            reference_grad += grad
            for name, value in metrics.items():   # token-weighted mean over the documents
                reference_metrics[name] = reference_metrics.get(name, 0.0) + value * length / total
            start += length

        documents = []
        for first, length in zip([1, 6, 15], LENGTHS):
            ids = torch.arange(first, first + length)
            documents.append(torch.stack([ids, ids, torch.ones_like(ids)], dim=1))
        pair = dist.new_group([0, 1])
        global_vars._GLOBAL_ARGS = argparse.Namespace(dcp=True)   # the patches act in --dcp runs only
        batch = build_batch(documents, cp_size=2, cp_rank=rank, group=pair, recompute=NO_RECOMPUTE, wave_index=0,
                            device="cpu", row_multiple=ROW_MULTIPLE, step_num_tokens=total)
        tokens = batch["tokens"][0]
        bounds = batch["cu_seqlens_padded"][0]
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds,
                                 max_seqlen_q=int(batch["max_seqlen"]), max_seqlen_kv=int(batch["max_seqlen"]),
                                 local_cp_size=2, cp_group=pair)
        attach_facts(params, batch[MICROBATCH_KEY])   # as DcpForwardStep / the DeepSpeed script do
        dcp_grad, dcp_metrics = run(table[tokens].unsqueeze(1), params)
        dist.all_reduce(dcp_grad, group=pair)   # the micro-batch's gradient: its ranks' contributions summed

        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
        model_parallel_cuda_manual_seed(1)
        tp_config = dataclasses.replace(config, tensor_model_parallel_size=2, sequence_parallel=True)
        tp_layer = TransformerLayer(tp_config, get_gpt_layer_local_spec(num_experts=4).submodules, layer_number=1)
        tp_layer.mlp.router.weight.data.copy_(router.weight.data)
        batch = build_batch(documents, cp_size=1, cp_rank=0, group=None, recompute=NO_RECOMPUTE, wave_index=0,
                            device="cpu", pad_multiple=2, row_multiple=ROW_MULTIPLE, step_num_tokens=total)
        tp_tokens = batch["tokens"][0]
        share = tp_tokens.numel() // 2
        bounds = batch["cu_seqlens_padded"][0]
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds,
                                 max_seqlen_q=int(batch["max_seqlen"]), max_seqlen_kv=int(batch["max_seqlen"]),
                                 local_cp_size=1, cp_group=None)
        attach_facts(params, batch[MICROBATCH_KEY])   # as DcpForwardStep / the DeepSpeed script do
        tp_grad, tp_metrics = run(table[tp_tokens[rank * share:(rank + 1) * share]].unsqueeze(1), params,
                                  layer=tp_layer)
        dist.all_reduce(tp_grad, group=pair)   # Megatron sums a sequence-parallel router's gradient over TP
        global_vars._GLOBAL_ARGS = None
        destroy_num_microbatches_calculator()
        destroy_moe_metrics_tracker()   # the next case in this launch records its own metrics
        parallel_state.destroy_model_parallel()
    # Plain lists: a tensor crosses the report queue as a shared-memory fd, which the parent cannot open once
    # this worker process has exited (ConnectionResetError).
    return {"reference": reference_grad.tolist(), "dcp": dcp_grad.tolist(), "reference_metrics": reference_metrics,
            "dcp_metrics": dcp_metrics, "rows": int(tokens.numel()), "real": int((tokens > 0).sum()),
            "tp": tp_grad.tolist(), "tp_metrics": tp_metrics, "tp_rows": int(tp_tokens.numel())}


def _every_kind_worker(rank: int, world_size: int) -> dict:
    """Both balancing kinds in one launch, one after the other (each sets up and tears down its own state)."""
    return {kind: _router_worker(rank, world_size, kind) for kind in METRICS}


@pytest.fixture(scope="module")
def router_results() -> dict[str, list[dict]]:
    """kind -> each rank's result (a launch's start-up is most of its cost: one for both kinds)."""
    per_rank = run_distributed(_every_kind_worker, 2)
    return {kind: [ranks[kind] for ranks in per_rank] for kind in METRICS}


@pytest.mark.parametrize("kind", list(METRICS))
def test_moe_balancing_and_z_losses_of_a_packed_cp2_microbatch_are_upstreams_per_document(router_results, kind):
    """patches/transformer_moe_router.py + transformer_transformer_layer.py: a CP-2 micro-batch of three documents
    (with padding and a filler document) gives the router the gradient of upstream's router run on each document
    alone, weighted per token; the logged metrics are the token-weighted means of upstream's per-document values.
    Fails with a per-micro-batch loss (the documents balanced together), without the group's all-reduce (each
    rank's rows alone), or with padding or filler rows counted. The same at TP 2 with sequence parallelism
    (moe_aux.RouterDocuments.sequence_parallel_share): fails without the token counts summed over the TP group."""
    results = router_results[kind]
    assert [r["rows"] for r in results] == [16, 16] and sum(r["real"] for r in results) == sum(LENGTHS)
    assert [r["tp_rows"] for r in results] == [32, 32]   # each TP rank routes 16
    expected = results[0]["reference_metrics"]
    assert set(expected) == {METRICS[kind], "z_loss"}, expected
    for layout, what in (("dcp", "CP-2"), ("tp", "TP-2 sequence-parallel")):
        for result in results:
            reference, dcp = torch.tensor(result["reference"]), torch.tensor(result[layout])
            assert float(reference.abs().max()) > 0
            err = float((dcp - reference).abs().max() / reference.abs().max())
            assert err < 1e-5, f"{kind}: router gradient of the {what} micro-batch differs from per-document by {err:.2e}"
        # logged: each rank's share, summed over the domain (the logger's reduce), times 1 / Megatron's 2
        # micro-batches
        for name, value in expected.items():
            logged = sum(r[f"{layout}_metrics"][name] for r in results) / 2
            assert logged == pytest.approx(value, rel=1e-5), (what, name, logged, value)
