"""MoE token dispatchers x expert-parallel size on DCP micro-batches (issue 30), one MoE layer on 2 gloo ranks.

One spawn runs every case: alltoall and allgather at EP 1 and EP 2, with expert biases (the EP 1 crash of
patches/tensor_parallel_layers.py), sigmoid scores with the router's expert bias (its token counts over the step's
micro-batches are the whole step's real tokens) and a lockstep plan whose ranks hold micro-batches of different rows (the
allgather dispatcher's all-gather needs equal rows: microbatches.rank_batches(equal_rows=True) pads each wave).
Each case's output and parameter gradients on real rows equal the alltoall dispatcher's on the unpadded
micro-batches with the same weights: the filler rows change nothing (loss, router statistics). The full runs
(tests/integration/test_megatron_moe.py) train the same dispatchers end to end.
"""
from __future__ import annotations

import argparse

import pytest
import torch

pytest.importorskip("megatron.core")

from dcp_megatron.core.microbatches import MICROBATCH_KEY, rank_batches, wave_local_rows  # noqa: E402
from dcp_megatron.planner.plan import Group, MicroBatch, StepPlan, Wave  # noqa: E402
from tests.support.dist_utils import run_distributed  # noqa: E402

HIDDEN = 16
# Wave 0: rank 0 a CP-1 micro-batch of two documents (12 + 6 rows), rank 1 one of 3 tokens (4 rows);
# wave 1: one CP-2 group (6 rows each). Sequence ids 1..4; lengths as given.
LENGTHS = {1: 11, 2: 5, 3: 3, 4: 9}
PLAN = StepPlan(domain_size=2, waves=(
    Wave(groups=(Group(0, 1, (MicroBatch(((1, 11), (2, 5))),)), Group(1, 1, (MicroBatch(((3, 3),)),)))),
    Wave(groups=(Group(0, 2, (MicroBatch(((4, 9),)),)),)),
))
CASES = [(dispatcher, ep) for ep in (1, 2) for dispatcher in ("alltoall", "allgather")]


def _documents() -> dict[int, torch.Tensor]:
    """Token ids 1.. back to back (0: what padding and filler rows hold), labels alike, loss mask 1."""
    documents, first = {}, 1
    for sid, length in LENGTHS.items():
        ids = torch.arange(first, first + length)
        documents[sid] = torch.stack([ids, ids, torch.ones_like(ids)], dim=1)
        first += length
    return documents


class _Pool:
    def __init__(self, rank: int, pair) -> None:
        self.domain_rank, self._pair = rank, pair

    def group(self, first_rank: int, size: int):
        return self._pair if size == 2 else None


def test_equal_rows_pad_every_ranks_microbatch_of_a_wave_to_the_waves_most_rows():
    """Unit: the wave's most local rows, reached by masked filler documents no longer than the step's longest."""
    assert wave_local_rows(PLAN) == [18, 6]
    for rank in (0, 1):
        pool = _Pool(rank, pair=object())
        padded = rank_batches(PLAN, _documents(), pool=pool, device="cpu", equal_rows=True)
        plain = rank_batches(PLAN, _documents(), pool=pool, device="cpu")
        assert [b["tokens"].shape[1] for b in padded] == [18, 6]
        assert [b["tokens"].shape[1] for b in plain] == ([18, 6] if rank == 0 else [4, 6])
        for got, was in zip(padded, plain):
            documents, before = got[MICROBATCH_KEY].router_documents, was[MICROBATCH_KEY].router_documents
            assert documents.document_lengths == before.document_lengths
            real = documents.valid_rows
            assert int(real.sum()) == int(before.valid_rows.sum()) == int(got["loss_mask"].sum())
            assert torch.equal(got["tokens"][0][real], was["tokens"][0][before.valid_rows])
            assert int(torch.diff(got["cu_seqlens_padded"][0]).max()) <= max(LENGTHS.values()) + 3
    with pytest.raises(ValueError, match="lockstep"):
        two = StepPlan(domain_size=1, waves=(Wave(groups=(Group(0, 1, (MicroBatch(((1, 11),)),
                                                                       MicroBatch(((2, 5),)))),)),))
        rank_batches(two, _documents(), pool=_Pool(0, None), device="cpu", equal_rows=True)


def _dispatch_worker(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.num_microbatches_calculator import (destroy_num_microbatches_calculator,
                                                           init_num_microbatches_calculator)
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from megatron.training import global_vars

    from dcp_megatron.core.microbatch_facts import MICROBATCH_KEY, attach_facts
    from patches.megatron_set import megatron_patch_registry

    results = {}
    with megatron_patch_registry():
        init_num_microbatches_calculator(0, None, 4, 1, world_size)
        global_vars._GLOBAL_ARGS = argparse.Namespace(dcp=True)   # the patches act in --dcp runs only
        pair = dist.new_group([0, 1])
        pool = _Pool(rank, pair)
        torch.manual_seed(0)
        table = torch.randn(sum(LENGTHS.values()) + 1, HIDDEN)   # row 0: padding and filler rows' input
        weights = torch.randn(sum(LENGTHS.values()) + 1, HIDDEN)  # d loss / d output of each real token
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))

        def run(layer, batches):
            """Real rows' outputs by token id, and every parameter's gradient, over the rank's micro-batches."""
            layer.zero_grad(set_to_none=True)
            outputs = {}
            for batch in batches:
                context = batch[MICROBATCH_KEY]
                bounds = batch["cu_seqlens_padded"][0]
                params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds,
                                         max_seqlen_q=int(batch["max_seqlen"]), max_seqlen_kv=int(batch["max_seqlen"]),
                                         local_cp_size=context.cp_size, cp_group=context.group)
                tokens = batch["tokens"][0]
                attach_facts(params, batch[MICROBATCH_KEY])   # as DcpForwardStep / the DeepSpeed script do
                output = layer._forward_mlp(table[tokens].unsqueeze(1), padding_mask=None,
                                            packed_seq_params=params)
                real = context.router_documents.valid_rows
                (output[:, 0][real] * weights[tokens[real]]).sum().backward()
                outputs.update(zip(tokens[real].tolist(), output[:, 0][real].detach()))
            grads = {name: p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None}
            return outputs, grads

        def expert_bias_counts(layer, batches):
            """The token counts the expert-bias update sees after the rank's micro-batches (summed over the domain,
            as finalize_model_grads does), and the counts of routing every real token of the step at once."""
            router = layer.mlp.router
            router.local_tokens_per_expert.zero_()
            run(layer, batches)
            counts = router.local_tokens_per_expert.clone()
            dist.all_reduce(counts)
            router.local_tokens_per_expert.zero_()
            router(layer.pre_mlp_layernorm(table[1:].unsqueeze(1)))   # every real token (rows 1..), no padding
            expected = router.local_tokens_per_expert.clone()
            router.local_tokens_per_expert.zero_()
            return float((counts - expected).abs().max()), float(expected.sum())

        for ep in (1, 2):
            parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
            model_parallel_cuda_manual_seed(1)
            layers = {}
            for dispatcher in ("alltoall", "allgather"):
                config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2,
                                           use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                                           add_bias_linear=True, num_moe_experts=4, moe_router_topk=2,
                                           moe_aux_loss_coeff=0.5, moe_router_load_balancing_type="seq_aux_loss",
                                           moe_z_loss_coeff=0.1, moe_token_dispatcher_type=dispatcher,
                                           expert_model_parallel_size=ep, calculate_per_token_loss=True,
                                           moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
                layers[dispatcher] = TransformerLayer(config, get_gpt_layer_local_spec(num_experts=4).submodules,
                                                      layer_number=1)
            layers["allgather"].load_state_dict(layers["alltoall"].state_dict())
            unpadded = rank_batches(PLAN, _documents(), pool=pool, device="cpu")
            padded = rank_batches(PLAN, _documents(), pool=pool, device="cpu", equal_rows=True)
            reference_outputs, reference_grads = run(layers["alltoall"], unpadded)
            assert any("experts" in name and "bias" in name for name in reference_grads), sorted(reference_grads)
            for dispatcher in ("alltoall", "allgather"):
                outputs, grads = run(layers[dispatcher], padded)
                assert outputs.keys() == reference_outputs.keys() and grads.keys() == reference_grads.keys()
                results[(dispatcher, ep)] = {
                    "output": max(float((outputs[t] - reference_outputs[t]).abs().max()) for t in outputs),
                    "grad": max(float((grads[n] - reference_grads[n]).abs().max()
                                      / reference_grads[n].abs().max().clamp(min=1e-30)) for n in grads),
                    "rows": [int(b["tokens"].shape[1]) for b in padded],
                    "router_grad": float(grads["mlp.router.weight"].abs().max()),
                    "bias_counts": expert_bias_counts(layers[dispatcher], padded)}
            parallel_state.destroy_model_parallel()
        global_vars._GLOBAL_ARGS = None
        destroy_num_microbatches_calculator()
    return results


def test_every_dispatcher_at_ep1_and_ep2_runs_padded_dcp_microbatches_and_matches_unpadded_alltoall():
    """Fails without the EP 1 bias fix (RuntimeError: a view modified in place, at EP 1 for both dispatchers) and
    without equal rows per wave (gloo aborts the allgather at EP 2), or if filler rows reach loss or router; and
    if the expert-bias counts of a step are not every micro-batch's real rows on every rank (one micro-batch's,
    or with padding), or the router's padding mask crashes the count (upstream's [T, E] & [T])."""
    results = run_distributed(_dispatch_worker, 2)
    for rank, result in enumerate(results):
        assert sorted(result) == sorted(CASES)
        for case, got in result.items():
            assert got["rows"] == [18, 6], (rank, case, got)
            assert got["router_grad"] > 0, (rank, case)   # the balancing and z losses reach the router
            assert got["output"] < 1e-5 and got["grad"] < 1e-5, (rank, case, got)
            # the expert bias's counts: every micro-batch's real rows of the step, none of a filler or padding row
            assert got["bias_counts"] == (0.0, 2.0 * sum(LENGTHS.values())), (rank, case, got["bias_counts"])


def test_flex_dispatcher_is_refused_without_a_gpu_and_gathering_dispatchers_under_ep_get_equal_rows():
    from dcp_megatron.config import DcpUsageError
    from dcp_megatron.training.checks.moe_checks import check_moe_dispatcher, needs_equal_rows

    def args(dispatcher, ep=1, experts=4):
        return argparse.Namespace(num_experts=experts, moe_token_dispatcher_type=dispatcher,
                                  expert_model_parallel_size=ep, moe_flex_dispatcher_backend="deepep")

    with pytest.raises(DcpUsageError, match="--moe-token-dispatcher-type flex .*needs a GPU"):
        check_moe_dispatcher(args("flex"), has_gpu=False)
    check_moe_dispatcher(args("flex"), has_gpu=True)
    for dispatcher in ("alltoall", "allgather"):
        check_moe_dispatcher(args(dispatcher), has_gpu=False)
    check_moe_dispatcher(args("flex", experts=None), has_gpu=False)   # a dense model never dispatches
    assert [needs_equal_rows(args(d, ep)) for d in ("alltoall", "allgather", "flex") for ep in (1, 2)] == \
        [False, False, False, True, False, True]
    assert not needs_equal_rows(args("allgather", 2, experts=None))
