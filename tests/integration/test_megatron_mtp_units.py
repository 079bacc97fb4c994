"""Under --dcp multi-token prediction shifts within each document on the micro-batch's CP group and weights its loss
per document (patches/transformer_multi_token_prediction.py, dcp_megatron/core/mtp_loss.py), checked against
upstream's own `process_mtp_loss` run on each document alone."""
from __future__ import annotations

import argparse
import types

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.support.dist_utils import run_distributed  # noqa: E402

HIDDEN, VOCAB = 8, 11
LENGTHS = (5, 8, 3)          # CP 1: padded to 6, 8, 4; CP 2: to 8, 8, 4 (and a filler document up to 16 rows); 8 unpadded
ROW_MULTIPLE = 16
SCALE = 0.3                  # --mtp-loss-scaling-factor


def _mtp_worker(rank: int, world_size: int) -> dict:
    """The MTP head's output-weight gradient and logged MTP loss, three ways:
    - reference: upstream's unpatched `process_mtp_loss` on each document alone (no packed params, no CP),
      per-token weighting, gradients summed over the documents, logged values weighted by document length;
    - one CP-1 micro-batch of the three documents (each padded to an even length), through the patched path;
    - one CP-2 micro-batch of them zig-zag over both ranks, with padding and a filler document.
    Padding and filler rows carry hidden states and labels of their own, so a shift across a document's end
    (or over the wrong group, or the unpadded bounds) changes the gradient."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import (destroy_num_microbatches_calculator,
                                                           init_num_microbatches_calculator)
    from megatron.core.transformer import multi_token_prediction as mtp
    from megatron.training import global_vars

    from dcp_megatron.core.microbatch_facts import packed_seq_params
    from dcp_megatron.core.microbatches import build_batch
    from dcp_megatron.planner.plan import NO_RECOMPUTE
    from patches.megatron_set import megatron_patch_registry

    with megatron_patch_registry():
        parallel_state.initialize_model_parallel()
        init_num_microbatches_calculator(0, None, 4, 1, world_size)   # 2 micro-batches per rank in Megatron's count
        num_microbatches = 2
        torch.manual_seed(0)
        total = sum(LENGTHS)
        table = torch.randn(total + 1, HIDDEN)           # row 0: padding and filler rows; 1 + i: the i-th token
        label_of = torch.randint(0, VOCAB, (total + 1,))
        weight = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN))
        config = types.SimpleNamespace(mtp_num_layers=1, mtp_loss_scaling_factor=SCALE, mtp_detach_heads=False,
                                       calculate_per_token_loss=True)
        mtp.MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))

        def head(hidden, weight=None, runtime_gather_output=None, _w=weight):
            return hidden @ _w.t(), None

        def token_losses(labels, logits):   # [b, s] from [s, b, V], as GPTModel's compute_language_model_loss
            return torch.nn.functional.cross_entropy(logits.transpose(0, 1).reshape(-1, VOCAB),
                                                     labels.reshape(-1), reduction="none").view_as(labels)

        def run(tokens, loss_mask, params):
            weight.grad = None
            mtp.MTPLossLoggingHelper.clean_metrics_in_tracker()
            hidden = table[tokens].unsqueeze(1)   # [s, 1, h]
            out = mtp.process_mtp_loss(hidden_states=torch.cat([hidden, hidden]), labels=label_of[tokens].unsqueeze(0),
                                       loss_mask=loss_mask, output_layer=head, output_weight=None,
                                       runtime_gather_output=None, is_training=True,
                                       compute_language_model_loss=token_losses, config=config,
                                       cp_group=None, tp_group=None, packed_seq_params=params)
            (out * 0).sum().backward()   # only the MTP loss reaches the head
            return weight.grad.clone(), float(mtp.MTPLossLoggingHelper.tracker["loss_values"][0])

        reference_grad, reference_logged, start = torch.zeros_like(weight), 0.0, 1
        for length in LENGTHS:
            ids = torch.arange(start, start + length)
            grad, logged = run(ids, torch.ones(1, length), None)
            reference_grad += grad
            reference_logged += logged * length / total    # token-weighted mean of per-document means
            start += length

        documents, start = [], 1
        for length in LENGTHS:
            ids = torch.arange(start, start + length)
            documents.append(torch.stack([ids, ids, torch.ones_like(ids)], dim=1))
            start += length
        global_vars._GLOBAL_ARGS = argparse.Namespace(dcp=True)
        results = {}
        pair = dist.new_group([0, 1])
        for cp_size, group in ((1, None), (2, pair)):
            batch = build_batch(documents, cp_size=cp_size, cp_rank=rank if cp_size > 1 else 0, group=group,
                                recompute=NO_RECOMPUTE, wave_index=0, device="cpu", row_multiple=ROW_MULTIPLE,
                                step_num_tokens=total)
            params = packed_seq_params(batch)
            grad, logged = run(batch["tokens"][0], batch["loss_mask"], params)
            if cp_size > 1:   # the micro-batch's gradient and logged record: its ranks' contributions summed
                dist.all_reduce(grad, group=pair)
                logged_sum = torch.tensor(logged)
                dist.all_reduce(logged_sum, group=pair)
                logged = float(logged_sum)
            # the logger averages the records over the domain's 2 ranks and multiplies by 1 / num_microbatches
            results[cp_size] = {"grad": grad.tolist(), "logged": logged / 2 / num_microbatches,
                                "rows": int(batch["tokens"].numel())}
        global_vars._GLOBAL_ARGS = None
        destroy_num_microbatches_calculator()
        parallel_state.destroy_model_parallel()
    return {"reference": reference_grad.tolist(), "reference_logged": reference_logged, "runs": results}


def test_mtp_loss_of_packed_microbatches_is_upstreams_per_document():
    """A CP-1 and a CP-2 micro-batch of three documents (padding, a filler document) give the MTP head upstream's
    gradient of each document alone, weighted per token, and log the token-weighted mean of upstream's values.
    Fails when the shift ignores document boundaries (or follows the unpadded bounds, or the static CP group),
    and with the micro-batch's token ratio in place of each document's."""
    results = run_distributed(_mtp_worker, 2)
    for result in results:
        reference = torch.tensor(result["reference"])
        assert float(reference.abs().max()) > 0
        for cp_size, run in result["runs"].items():
            err = float((torch.tensor(run["grad"]) - reference).abs().max() / reference.abs().max())
            assert err < 1e-5, f"CP-{cp_size} micro-batch: MTP head gradient differs from per-document by {err:.2e}"
            assert run["logged"] == pytest.approx(result["reference_logged"], rel=1e-5), (cp_size, run["logged"])
    assert [r["runs"][2]["rows"] for r in results] == [16, 16]
