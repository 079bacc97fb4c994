"""Under --dcp an MoE router reduces over each micro-batch's own CP group (patches/transformer_transformer_layer.py)."""
from __future__ import annotations

import argparse

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.dist_utils import run_distributed  # noqa: E402


def _moe_router_worker(rank: int, world_size: int) -> dict:
    """An MoE layer's router gradient from its load-balancing aux loss: one micro-batch of 12 tokens on each rank
    alone (CP 1), then the same micro-batch split over a CP group of both ranks (6 rows each)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from megatron.training import global_vars

    from dcp_megatron.megatron.patch_set import megatron_patch_registry

    tokens, hidden = 12, 16
    with megatron_patch_registry():
        parallel_state.initialize_model_parallel()
        model_parallel_cuda_manual_seed(1)
        global_vars._GLOBAL_ARGS = argparse.Namespace(dcp=True)   # the patch acts in --dcp runs only
        torch.manual_seed(0)
        config = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=2,
                                   use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                                   add_bias_linear=False, num_moe_experts=4, moe_router_topk=2,
                                   moe_aux_loss_coeff=1.0, moe_router_load_balancing_type="aux_loss",
                                   moe_token_dispatcher_type="alltoall", calculate_per_token_loss=True)
        spec = get_gpt_layer_local_spec(num_experts=4)
        layer = TransformerLayer(config, spec.submodules, layer_number=1)
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
        rows = torch.randn(tokens, 1, hidden)
        pair = dist.new_group([0, 1])

        def router_grad(local_rows, cp_group, cp_size):
            bounds = torch.tensor([0, tokens], dtype=torch.int32)
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds,
                                     max_seqlen_q=tokens, max_seqlen_kv=tokens, local_cp_size=cp_size,
                                     cp_group=cp_group)
            layer.zero_grad(set_to_none=True)
            output = layer._forward_mlp(local_rows, padding_mask=None, packed_seq_params=params)
            (output * 0).sum().backward()   # only the aux loss reaches the router weight
            return layer.mlp.router.weight.grad.clone()

        whole = router_grad(rows, None, 1)
        split = router_grad(rows[rank * tokens // 2:(rank + 1) * tokens // 2], pair, 2)
        dist.all_reduce(split, group=pair)   # the micro-batch's gradient: its ranks' contributions summed
        global_vars._GLOBAL_ARGS = None
        parallel_state.destroy_model_parallel()
    # Plain lists: a tensor crosses the report queue as a shared-memory fd, which the parent cannot open once
    # this worker process has exited (ConnectionResetError).
    return {"whole": whole.tolist(), "split": split.tolist()}


def test_moe_aux_loss_of_a_cp2_microbatch_reduces_over_its_own_group():
    """patches/transformer_transformer_layer.py: under --dcp the router counts tokens per expert over the
    micro-batch's CP group (not the static TP x CP group of size 1) and scales by its size, so the aux-loss
    gradient of a micro-batch split over two ranks equals that of the whole micro-batch on one rank."""
    whole, split = (torch.tensor(v) for v in run_distributed(_moe_router_worker, 2)[0].values())
    assert float(whole.abs().max()) > 0
    err = float((split - whole).abs().max() / whole.abs().max())
    assert err < 1e-5, f"aux-loss gradient of the CP-2 micro-batch differs from one rank's by {err:.2e}"
