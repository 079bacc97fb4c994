"""Switch a plain torch model's activation recompute per micro-batch.

The plan picks a Recompute per micro-batch from its memory headroom. Blocks read two switches at
every forward (see reference_model.TinyGPT): `block.checkpoint_layer` (torch checkpoint of the
whole block, use_reentrant=False) and `block.attn.checkpoint_core_attention` (checkpoint of the
core attention only). Setting them right before a micro-batch's forward is enough: recomputation
during backward replays exactly the flags that were active in that micro-batch's forward, since
non-reentrant checkpointing records the function it wraps when the forward runs.

Every member of a CP group runs the same micro-batch with the same Recompute, so recomputed
CP collectives are issued in the same order on all members.
"""
from __future__ import annotations

from dcp_megatron.planner.plan import Recompute


def _layers(model) -> list:
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no .layers; recompute switches live on its transformer blocks")
    return list(layers)


def apply_recompute(model, recompute: Recompute) -> None:
    """none: keep all activations; selective: recompute core attention in every block;
    full k: checkpoint the first k blocks (the rest keep their activations)."""
    layers = _layers(model)
    if recompute.kind == "full" and recompute.full_layers > len(layers):
        raise ValueError(f"recompute {recompute} asks for {recompute.full_layers} layers, the model has {len(layers)}")
    for index, block in enumerate(layers):
        block.checkpoint_layer = recompute.kind == "full" and index < recompute.full_layers
        block.attn.checkpoint_core_attention = recompute.kind == "selective"


def current_recompute(model) -> Recompute:
    """The Recompute the model's switches currently describe (ValueError if they match none)."""
    layers = _layers(model)
    full = [bool(block.checkpoint_layer) for block in layers]
    selective = [bool(block.attn.checkpoint_core_attention) for block in layers]
    num_full = sum(full)
    if num_full and full == [True] * num_full + [False] * (len(layers) - num_full) and not any(selective):
        return Recompute("full", num_full)
    if not num_full and all(selective):
        return Recompute("selective")
    if not num_full and not any(selective):
        return Recompute("none")
    raise ValueError(f"recompute switches match no policy: checkpoint_layer={full}, "
                     f"checkpoint_core_attention={selective}")
