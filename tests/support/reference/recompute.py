"""Switch a plain torch model's activation recompute per micro-batch.

The plan picks a Recompute per micro-batch from its memory headroom. Blocks read three switches at
every forward (see tiny_gpt.TinyGPT): `block.checkpoint_layer` (torch checkpoint of the
whole block, use_reentrant=False), `block.attn.checkpoint_core_attention` (the core attention only:
module "core_attn") and `block.checkpoint_mlp` (the MLP only: module "mlp"). Setting them right before a micro-batch's forward is enough: recomputation
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


# The recompute modules the reference GPT has (it has no MoE and its norms are not checkpointed).
MODULES = frozenset({"core_attn", "mlp"})


def apply_recompute(model, recompute: Recompute) -> None:
    """none: keep all activations; module recompute: checkpoint those modules in every block;
    full k: checkpoint the first k blocks (the rest keep their activations)."""
    layers = _layers(model)
    if recompute.kind == "full" and recompute.full_layers > len(layers):
        raise ValueError(f"recompute {recompute} asks for {recompute.full_layers} layers, the model has {len(layers)}")
    modules = recompute.modules if recompute.kind == "selective" else frozenset()
    if modules - MODULES:
        raise ValueError(f"recompute {recompute}: the reference GPT has no {sorted(modules - MODULES)} to recompute")
    for index, block in enumerate(layers):
        block.checkpoint_layer = recompute.kind == "full" and index < recompute.full_layers
        block.attn.checkpoint_core_attention = "core_attn" in modules
        block.checkpoint_mlp = "mlp" in modules


def current_recompute(model) -> Recompute:
    """The Recompute the model's switches currently describe (ValueError if they match none)."""
    layers = _layers(model)
    full = [bool(block.checkpoint_layer) for block in layers]
    attention = [bool(block.attn.checkpoint_core_attention) for block in layers]
    mlp = [bool(block.checkpoint_mlp) for block in layers]
    num_full = sum(full)
    if num_full and full == [True] * num_full + [False] * (len(layers) - num_full) and not any(attention + mlp):
        return Recompute("full", num_full)
    if not num_full and len(set(attention)) == 1 and len(set(mlp)) == 1:
        return Recompute.of_modules({name for name, on in (("core_attn", attention[0]), ("mlp", mlp[0])) if on})
    raise ValueError(f"recompute switches match no policy: checkpoint_layer={full}, "
                     f"checkpoint_core_attention={attention}, checkpoint_mlp={mlp}")
