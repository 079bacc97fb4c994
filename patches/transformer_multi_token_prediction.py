"""Patches for `megatron.core.transformer.multi_token_prediction` (under --dcp, DCP micro-batches only):
multi-token prediction shifts within each document on the micro-batch's own CP group, and weights its loss per
document.

- `roll_tensor` shifts labels, the loss mask, input ids and positions left by one within each packed document; it
  takes the CP group from its caller, which is the static one (size 1 under DCP) in GPTModel and in every MTP
  layer, and the document bounds from `cu_seqlens_q`. For a DCP micro-batch it gets the micro-batch's group and
  the padded bounds its zig-zag shards follow (the facts' `padded_lengths`), whatever the caller passed.
- `process_mtp_loss` scales the MTP token losses by a ratio of token counts over the whole micro-batch and logs
  a mean of per-micro-batch means: both depend on the plan's packing. For a DCP micro-batch the ratio is each
  document's and the logged value its token-weighted mean (dcp_megatron/core/mtp_loss.py says what and why).
Everything else, and every call without a DCP micro-batch's params, runs upstream's code.

CPU shim (no GPU only): its `torch` is a CPU view; the MTP logger creates its buffers on
`torch.cuda.current_device()`.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect

from patches import MEGATRON_CORE_VERSIONS
from patches.cpu_torch import cpu_torch_patch
from patches.registry import Patch

_MODULE = "megatron.core.transformer.multi_token_prediction"
CPU_PATCHES = (cpu_torch_patch(_MODULE, "the MTP loss logger creates its buffers on torch.cuda.current_device().",
                               MEGATRON_CORE_VERSIONS),)


def _on_microbatch_group(original_roll):
    @functools.wraps(original_roll)
    def roll_tensor(tensor, shifts=-1, dims=-1, cp_group=None, packed_seq_params=None):
        import torch

        from dcp_megatron.core.microbatch_facts import facts_of

        facts = facts_of(packed_seq_params)
        if facts is None or tensor is None:
            return original_roll(tensor, shifts, dims, cp_group, packed_seq_params)
        lengths = torch.tensor((0, *facts.padded_lengths), dtype=torch.int64)
        bounds = torch.cumsum(lengths, 0).to(packed_seq_params.cu_seqlens_q.device)
        params = dataclasses.replace(packed_seq_params, cu_seqlens_q=bounds, cu_seqlens_kv=bounds)
        return original_roll(tensor, shifts, dims, facts.group, params)

    roll_tensor.dcp_original = original_roll
    return roll_tensor


def _per_document(original_process):
    signature = inspect.signature(original_process)

    @functools.wraps(original_process)
    def process_mtp_loss(*args, **kwargs):
        from dcp_megatron.core.microbatch_facts import facts_of

        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        facts = facts_of(call.arguments["packed_seq_params"])
        if facts is None or facts.router_documents is None or call.arguments["labels"] is None:
            return original_process(*args, **kwargs)
        return _per_document_mtp_loss(facts, **call.arguments)

    process_mtp_loss.dcp_original = original_process
    return process_mtp_loss


def _per_document_mtp_loss(facts, *, hidden_states, labels, loss_mask, output_layer, output_weight,
                           runtime_gather_output, is_training, compute_language_model_loss, config, cp_group,
                           tp_group, packed_seq_params, scale_logits_fn, input_ids):
    """Upstream's process_mtp_loss with labels given and per-token loss (DCP sets it), the ratio per document."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.transformer import multi_token_prediction as mtp

    from dcp_megatron.core.mtp_loss import logged_mtp_share, mtp_row_weights

    assert config.calculate_per_token_loss, "--dcp runs with --calculate-per-token-loss"
    documents = facts.router_documents
    hidden_states_list = torch.chunk(hidden_states, 1 + config.mtp_num_layers, dim=0)
    hidden_states = hidden_states_list[0]
    if config.mtp_detach_heads:
        output_weight = (output_weight if output_weight is not None else output_layer.weight).detach()
    mtp_labels = labels.clone()
    original_mask = loss_mask if loss_mask is not None else torch.ones_like(mtp_labels)
    rolled_mask = original_mask
    loss_scale = config.mtp_loss_scaling_factor / config.mtp_num_layers
    for depth in range(config.mtp_num_layers):
        mtp_logits, _ = output_layer(hidden_states_list[depth + 1], weight=output_weight,
                                     runtime_gather_output=runtime_gather_output)
        if scale_logits_fn is not None:
            mtp_logits = scale_logits_fn(mtp_logits)
        mtp_labels, _ = mtp.roll_tensor(mtp_labels, shifts=-1, dims=-1, cp_group=cp_group,
                                        packed_seq_params=packed_seq_params)
        rolled_mask, _ = mtp.roll_tensor(rolled_mask, shifts=-1, dims=-1, cp_group=cp_group,
                                         packed_seq_params=packed_seq_params)
        token_losses = rolled_mask * compute_language_model_loss(mtp_labels, mtp_logits)
        weights = mtp_row_weights(original_mask, rolled_mask, documents, facts.group)
        if is_training:
            average_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
            correct, total = mtp._compute_mtp_acceptance_counts(mtp_logits, mtp_labels, rolled_mask, output_layer,
                                                                runtime_gather_output, tp_group)
            share = logged_mtp_share(token_losses, weights, documents, average_size=average_group.size(),
                                     num_microbatches=get_num_microbatches())
            mtp.MTPLossLoggingHelper.save_metrics_to_tracker(share, correct, total, depth, config.mtp_num_layers,
                                                             avg_group=average_group)
        hidden_states = mtp.MTPLossAutoScaler.apply(hidden_states, loss_scale * token_losses * weights.gradient)
    return hidden_states


def dcp_patches() -> tuple[Patch, ...]:
    from megatron.core.transformer import multi_token_prediction as mtp

    def unwrapped(name: str):
        current = getattr(mtp, name)
        return getattr(current, "dcp_original", current)

    return (
        Patch(target=f"{_MODULE}:roll_tensor", replacement=_on_microbatch_group(unwrapped("roll_tensor")),
              reason="MTP's shift takes the static CP group (size 1 under DCP) from GPTModel and its layers; a DCP "
                     "micro-batch's documents lie zig-zag over a CP group of its own, padded per document.",
              versions=MEGATRON_CORE_VERSIONS),
        Patch(target=f"{_MODULE}:process_mtp_loss", replacement=_per_document(unwrapped("process_mtp_loss")),
              reason="the MTP loss is scaled by a token-count ratio of the whole micro-batch and logged as a mean of "
                     "per-micro-batch means; a DCP micro-batch is a plan's packing of documents: per document.",
              versions=MEGATRON_CORE_VERSIONS),
    )
