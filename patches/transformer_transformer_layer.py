"""Patch for `megatron.core.transformer.transformer_layer` (under --dcp, MoE layers only): the router of a DCP
micro-batch reduces over the micro-batch's own CP group, and packed micro-batches stay one sequence.

megatron-core 0.19.2's router (moe/router.py) reduces the per-expert token counts behind the load-balancing
and sequence aux losses over `Router.tp_cp_group`, the static TP x CP group fixed at construction, and scales
the aux and z losses by that group's size (their gradient normalisation under --calculate-per-token-loss).
Under DCP the static CP size is 1 and every micro-batch runs on a CP group of its own (size 1, 2, 3, ...), so
upstream would compute each rank's aux loss from its shard alone, and count the rows DCP pads each document with. `TransformerLayer._forward_mlp` is the
narrowest seam that sees both the MoE layer and the micro-batch's `PackedSeqParams` (it receives them, and full
recompute replays it with the same arguments): for the duration of one call the router sees the micro-batch's
group as its `tp_cp_group` (TP is 1 under --dcp with MoE, layout_checks.py), and the layer's `padding_mask`
(upstream's seam for rows the router must not count) marks the micro-batch's padding rows. The metrics tracker keeps the static
group: it reduces once per step, over the group of each metric's last record, which differs between ranks.

Megatron-LM's pretrain_gpt.py also sets `PackedSeqParams.tokens_per_sample = --seq-length`, and
`_maybe_unflatten_for_moe` then cuts the packed rows into samples of that length; a DCP micro-batch holds whole
documents of any total length (its own packing, not Megatron's samples), so it stays one sequence.

Only DCP micro-batches are affected (`PackedSeqParams.local_cp_size` set during a --dcp run); everything else
passes through.
"""
from __future__ import annotations

import functools

from patches import MEGATRON_CORE_VERSIONS
from patches.registry import Patch

_MODULE = "megatron.core.transformer.transformer_layer"


def _is_dcp_microbatch(packed_seq_params) -> bool:
    if getattr(packed_seq_params, "local_cp_size", None) is None:
        return False
    from megatron.training import global_vars   # a --dcp run (Megatron's own hybrid CP also sets local_cp_size)

    return bool(getattr(getattr(global_vars, "_GLOBAL_ARGS", None), "dcp", False))


def _router_on_microbatch_group(original):
    @functools.wraps(original)
    def _forward_mlp(self, hidden_states, *args, **kwargs):
        packed_seq_params = kwargs.get("packed_seq_params")
        router = getattr(getattr(self, "mlp", None), "router", None)
        if router is None or not self.is_moe_layer or not _is_dcp_microbatch(packed_seq_params):
            return original(self, hidden_states, *args, **kwargs)
        if kwargs.get("padding_mask") is None:
            kwargs["padding_mask"] = _padding_rows(packed_seq_params)
        static_group = router.tp_cp_group
        # A group of one has no group object: the rank alone (the static TP x CP group, of size 1 under --dcp).
        microbatch_group = packed_seq_params.cp_group or static_group
        router.tp_cp_group = microbatch_group
        try:
            return original(self, hidden_states, *args, **kwargs)
        finally:
            router.tp_cp_group = static_group
            _log_over_static_group(microbatch_group, static_group)

    _forward_mlp.dcp_original = original
    return _forward_mlp


def _padding_rows(packed_seq_params):
    """The micro-batch's padding rows ([1, T_local], True at padding), so that the router leaves them out of its
    token counts, aux and z losses (a document padded to a multiple of 2c is still one document). Read from the
    running DCP micro-batch and kept on its PackedSeqParams, which full recompute replays in backward, when no
    micro-batch is running."""
    from dcp_megatron.megatron.forward_step import current_microbatch
    from dcp_megatron.megatron.microbatches import MICROBATCH_KEY

    mask = getattr(packed_seq_params, "dcp_padding_mask", None)
    batch = current_microbatch()
    if mask is None and batch is not None:
        mask = batch[MICROBATCH_KEY].padding_mask
        packed_seq_params.dcp_padding_mask = mask
    return mask


def _log_over_static_group(microbatch_group, static_group) -> None:
    """The MoE metrics tracker remembers the group of each metric's last record and reduces over it once per
    step; ranks' last micro-batch groups differ, so the logged metrics keep the static group."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    for entry in get_moe_metrics_tracker().metrics.values():
        if entry.reduce_group is microbatch_group:
            entry.reduce_group = static_group


def _one_sequence_per_dcp_microbatch(original):
    @functools.wraps(original)
    def _maybe_unflatten_for_moe(self, hidden_states, padding_mask, packed_seq_params):
        if _is_dcp_microbatch(packed_seq_params):
            return hidden_states, padding_mask, None
        return original(self, hidden_states, padding_mask, packed_seq_params)

    _maybe_unflatten_for_moe.dcp_original = original
    return _maybe_unflatten_for_moe


def dcp_patches() -> tuple[Patch, ...]:
    from megatron.core.transformer.transformer_layer import TransformerLayer

    def unwrapped(name: str):
        current = vars(TransformerLayer)[name]
        return getattr(current, "dcp_original", current)

    return (
        Patch(target=f"{_MODULE}:TransformerLayer._forward_mlp",
              replacement=_router_on_microbatch_group(unwrapped("_forward_mlp")),
              reason="the MoE router reduces aux-loss token counts over the static TP x CP group; a DCP "
                     "micro-batch runs on its own CP group.",
              versions=MEGATRON_CORE_VERSIONS),
        Patch(target=f"{_MODULE}:TransformerLayer._maybe_unflatten_for_moe",
              replacement=_one_sequence_per_dcp_microbatch(unwrapped("_maybe_unflatten_for_moe")),
              reason="tokens_per_sample (--seq-length) would cut a DCP micro-batch of packed documents into "
                     "Megatron's samples.",
              versions=MEGATRON_CORE_VERSIONS),
    )
