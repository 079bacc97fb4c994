"""Patches for `megatron.core.transformer.moe.router`.

CPU shim (no GPU only): its `torch` is a CPU view; the router moves its weight to `torch.cuda.current_device()` and
creates its aux-loss/statistics buffers there.

Under --dcp (a DCP micro-batch only, i.e. while the transformer-layer patch has set `router.dcp_documents`):
`TopKRouter._apply_aux_loss`, `_apply_seq_aux_loss` and `apply_z_loss` compute their losses per document of the
micro-batch (dcp_megatron/core/moe_aux.py says why and what). Upstream computes the balancing losses from
the token counts of the whole micro-batch (or sample) reduced over `tp_cp_group`, the static TP x CP group; a DCP
micro-batch is a plan-dependent packing of documents on a CP group of its own, with padding and filler rows. The
losses keep upstream's per-token gradient weighting (attached with `MoEAuxLossAutoScaler`, scaled by 1 / the
step's tokens in finalize_model_grads) and are recorded for Megatron's MoE logger as each rank's share, reduced
over the whole TP x DP x CP domain, so the printed values are token-weighted means over the step. Everything else
passes through.

Every run: `TopKRouter._apply_expert_bias` (`--moe-router-enable-expert-bias`) masks the routing map [T, E] with the
flattened padding mask [T], which does not broadcast; DCP passes the padding mask of every micro-batch (padding and
filler rows must not count), so the mask gets its expert dimension. The counts themselves stay upstream's: summed
over all of the step's micro-batches on each rank, all-reduced over the TP x DP x CP group (the DCP domain) once
per step in finalize_model_grads, so the bias update sees the whole global batch's counts as the plain run does.
"""
from __future__ import annotations

import functools

from patches.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS
from patches.registry import Patch

_REASON = "the router moves its weight to `torch.cuda.current_device()` and creates its aux-loss/statistics buffers there."
_MODULE = "megatron.core.transformer.moe.router"
CPU_PATCHES = (cpu_torch_patch(_MODULE, _REASON, MEGATRON_CORE_VERSIONS),)

# upstream aux-loss kind -> the metric name upstream logs it under
_BALANCING = {"_apply_aux_loss": ("aux_loss", "load_balancing_loss"),
              "_apply_seq_aux_loss": ("seq_aux_loss", "seq_load_balancing_loss")}


def _record(router, name: str, share, documents) -> None:
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    from dcp_megatron.core.moe_aux import logged_share

    get_moe_metrics_tracker().record(
        name, logged_share(share, documents, get_num_microbatches()), router.layer_number,
        router.config.num_layers,
        reduce_group=parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True))


def _per_document_balancing(original, kind: str, metric: str):
    @functools.wraps(original)
    def apply(self, probs, scores_for_aux_loss, routing_map, *args, **kwargs):
        documents = getattr(self, "dcp_documents", None)
        coeff = self.get_aux_loss_coeff(kind)
        if documents is None or coeff == 0:
            return original(self, probs, scores_for_aux_loss, routing_map, *args, **kwargs)
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        from dcp_megatron.core.moe_aux import load_balancing_loss

        loss, share = load_balancing_loss(scores_for_aux_loss, routing_map, documents, topk=self.topk,
                                          num_experts=self.config.num_moe_experts, coeff=coeff)
        _record(self, metric, share, documents)
        return MoEAuxLossAutoScaler.apply(probs, loss)

    apply.dcp_original = original
    return apply


def _per_token_z_loss(original):
    @functools.wraps(original)
    def apply_z_loss(self, logits, padding_mask=None):
        import torch

        documents = getattr(self, "dcp_documents", None)
        coeff = self.config.moe_z_loss_coeff
        if documents is None or coeff is None or not (self.training and torch.is_grad_enabled()):
            return original(self, logits, padding_mask=padding_mask)
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        from dcp_megatron.core.moe_aux import z_loss

        loss, share = z_loss(logits, documents, coeff=coeff)
        _record(self, "z_loss", share, documents)
        return MoEAuxLossAutoScaler.apply(logits, loss)

    apply_z_loss.dcp_original = original
    return apply_z_loss


def _with_broadcast_padding_mask(original):
    @functools.wraps(original)
    def _apply_expert_bias(self, routing_map, padding_mask=None):
        if padding_mask is not None and padding_mask.dim() == routing_map.dim() - 1:
            padding_mask = padding_mask.unsqueeze(-1)
        return original(self, routing_map, padding_mask=padding_mask)

    _apply_expert_bias.dcp_original = original
    return _apply_expert_bias


def dcp_patches() -> tuple[Patch, ...]:
    from megatron.core.transformer.moe.router import TopKRouter

    def unwrapped(name: str):
        current = vars(TopKRouter)[name]
        return getattr(current, "dcp_original", current)

    balancing = tuple(
        Patch(target=f"{_MODULE}:TopKRouter.{name}",
              replacement=_per_document_balancing(unwrapped(name), kind, metric),
              reason=f"{kind} counts tokens per expert over a whole micro-batch on the static TP x CP group; a DCP "
                     "micro-batch is a plan's packing of documents on its own CP group: per document instead.",
              versions=MEGATRON_CORE_VERSIONS)
        for name, (kind, metric) in _BALANCING.items())
    return balancing + (
        Patch(target=f"{_MODULE}:TopKRouter.apply_z_loss", replacement=_per_token_z_loss(unwrapped("apply_z_loss")),
              reason="the z-loss is scaled by the static TP x CP group and logged per micro-batch; a DCP micro-batch "
                     "has its own CP group and filler rows.",
              versions=MEGATRON_CORE_VERSIONS),
        Patch(target=f"{_MODULE}:TopKRouter._apply_expert_bias",
              replacement=_with_broadcast_padding_mask(unwrapped("_apply_expert_bias")),
              reason="the expert-bias token count masks the [T, E] routing map with a [T] padding mask, which does "
                     "not broadcast (a crash whenever a padding mask is given, as under --dcp).",
              versions=MEGATRON_CORE_VERSIONS),)
