"""Patch for `megatron.core.transformer.transformer_layer`: a DCP micro-batch's MLP recompute is its own, also when
full recompute replays it later; (under --dcp, MoE layers only) the router of a DCP micro-batch knows the
micro-batch's documents, and packed micro-batches stay one sequence.

The MLP side's module recompute (`TransformerLayer.recompute_mlp`, a MoE layer's `moe_layer_recompute` and
`shared_experts_recompute`) is read by `_forward_mlp` at every call, replays included; for a call with a DCP
micro-batch's params it is pinned to that micro-batch's choice (`_pin_mlp_recompute`, the same reason as the core
attention pin in patches/transformer_attention.py).

megatron-core 0.19.2's router sees only the rows it routes. Under DCP its balancing losses are per document
(dcp_megatron/core/moe_aux.py, patches/transformer_moe_router.py), over the ranks of the micro-batch's own CP
group, and must skip the rows DCP adds: each document's padding to a multiple of 2c and the filler documents (an
idle rank's, the row alignment's). `TransformerLayer._forward_mlp` is the narrowest seam that sees both the MoE
layer and the micro-batch's `PackedSeqParams` (it receives them, and full recompute replays it with the same
arguments): for the duration of one call the router holds the micro-batch's `RouterDocuments` as
`router.dcp_documents`, and the layer's `padding_mask` (upstream's seam for rows the router must not count: the
token counts of `--moe-router-enable-expert-bias`) marks padding and filler rows. Under sequence parallelism
(TP > 1) both are this TP rank's share of the rows, and the documents' token counts are summed over the TP group
too.

Megatron-LM's pretrain_gpt.py also sets `PackedSeqParams.tokens_per_sample = --seq-length`, and
`_maybe_unflatten_for_moe` then cuts the packed rows into samples of that length; a DCP micro-batch holds whole
documents of any total length (its own packing, not Megatron's samples), so it stays one sequence.

Only DCP micro-batches are affected: params carrying a micro-batch's facts (`facts_of`,
dcp_megatron/core/microbatch_facts.py, whose `router_documents` the router gets) during a megatron.training
--dcp run; everything else passes through. (The DeepSpeed script sets no megatron.training args: its MoE layers
keep upstream's router, as before the facts had a carrier.)
"""
from __future__ import annotations

import functools

from patches import MEGATRON_CORE_VERSIONS
from patches.registry import Patch

_MODULE = "megatron.core.transformer.transformer_layer"


def _is_dcp_microbatch(packed_seq_params) -> bool:
    from dcp_megatron.core.microbatch_facts import facts_of

    if facts_of(packed_seq_params) is None:
        return False
    from megatron.training import global_vars   # a megatron.training --dcp run (module docstring)

    return bool(getattr(getattr(global_vars, "_GLOBAL_ARGS", None), "dcp", False))


def _router_on_microbatch_documents(original):
    @functools.wraps(original)
    def _forward_mlp(self, hidden_states, *args, **kwargs):
        from dcp_megatron.core.microbatch_facts import facts_of

        facts = facts_of(kwargs.get("packed_seq_params"))
        if facts is None:
            return original(self, hidden_states, *args, **kwargs)
        pinned = _pin_mlp_recompute(self, facts.recompute_modules)
        try:
            return _with_router_documents(original, self, hidden_states, *args, **kwargs)
        finally:
            for module, attribute, value in pinned:
                setattr(module, attribute, value)

    _forward_mlp.dcp_original = original
    return _forward_mlp


# The MLP side's module-recompute switches megatron-core 0.19.2 reads inside `_forward_mlp`: (owner, attribute, name).
_MLP_SWITCHES = (("layer", "recompute_mlp", "mlp"), ("mlp", "moe_layer_recompute", "moe"),
                 ("mlp", "shared_experts_recompute", "shared_experts"))


def _pin_mlp_recompute(layer, modules) -> list:
    """Set the MLP side's recompute switches to the micro-batch's own choice for this call; what to restore.

    DCP sets them before each micro-batch's forward (dcp_megatron/core/recompute.py), but a full-recompute replay
    reads them again in backward, when (under pipeline parallelism) a later micro-batch's choice is set: the replay
    would then checkpoint an MLP its micro-batch did not (an extra forward in backward, and a MoE layer's token
    dispatch issued again on one EP peer only). The facts give the micro-batch's own set, at every replay alike."""
    pinned = []
    for owner, attribute, name in _MLP_SWITCHES:
        module = layer if owner == "layer" else getattr(layer, "mlp", None)
        if module is None or not hasattr(module, attribute):
            continue
        if name == "mlp" and getattr(layer, "is_moe_layer", False):
            continue   # upstream never checkpoints a MoE layer as "mlp"
        pinned.append((module, attribute, getattr(module, attribute)))
        setattr(module, attribute, name in modules)
    return pinned


def _with_router_documents(original, self, hidden_states, *args, **kwargs):
    packed_seq_params = kwargs.get("packed_seq_params")
    router = getattr(getattr(self, "mlp", None), "router", None)
    if router is None or not self.is_moe_layer or not _is_dcp_microbatch(packed_seq_params):
        return original(self, hidden_states, *args, **kwargs)
    documents = _microbatch_documents(packed_seq_params)
    if documents is None:   # not run by DCP's schedule (evaluation goes Megatron's way)
        return original(self, hidden_states, *args, **kwargs)
    if self.config.sequence_parallel and self.config.tensor_model_parallel_size > 1:
        documents = _sequence_parallel_share(documents)
    if kwargs.get("padding_mask") is None:
        kwargs["padding_mask"] = documents.padding_mask
    router.dcp_documents = documents
    try:
        return original(self, hidden_states, *args, **kwargs)
    finally:
        router.dcp_documents = None


def _microbatch_documents(packed_seq_params):
    """The DCP micro-batch's RouterDocuments, from the facts its params carry (full recompute replays the layer in
    backward with the same params, so the same documents); None without them."""
    from dcp_megatron.core.microbatch_facts import facts_of

    facts = facts_of(packed_seq_params)
    return None if facts is None else facts.router_documents


def _sequence_parallel_share(documents):
    """Under sequence parallelism the MLP sees this TP rank's contiguous share of the micro-batch's rows (upstream
    scatters its own padding mask the same way, in GPTModel)."""
    from megatron.core import parallel_state

    return documents.sequence_parallel_share(parallel_state.get_tensor_model_parallel_rank(),
                                             parallel_state.get_tensor_model_parallel_world_size(),
                                             parallel_state.get_tensor_model_parallel_group())


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
              replacement=_router_on_microbatch_documents(unwrapped("_forward_mlp")),
              reason="a full-recompute replay reads the latest micro-batch's MLP recompute switches; and the MoE "
                     "router sees only its rows: under DCP its losses are per document of the micro-batch (on the "
                     "micro-batch's own CP group), without padding and filler rows.",
              versions=MEGATRON_CORE_VERSIONS),
        Patch(target=f"{_MODULE}:TransformerLayer._maybe_unflatten_for_moe",
              replacement=_one_sequence_per_dcp_microbatch(unwrapped("_maybe_unflatten_for_moe")),
              reason="tokens_per_sample (--seq-length) would cut a DCP micro-batch of packed documents into "
                     "Megatron's samples.",
              versions=MEGATRON_CORE_VERSIONS),
    )
