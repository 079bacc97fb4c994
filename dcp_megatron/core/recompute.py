"""Switch a megatron-core model's activation recompute per micro-batch (docs/megatron.md).

Full (block) recompute is read from the TransformerConfig at every forward, and all modules
share one config object, so setting `recompute_granularity/method/num_layers` right before a
micro-batch's forward is enough (also inside 1F1B: the checkpoint records what it wraps when
the forward runs). Selective recompute of core attention is cached per module at construction
(`Attention.checkpoint_core_attention`), so that attribute is set on every attention module.
Only core attention is recomputed selectively: selective MLP recompute with biases never
terminates on 0.16.1 and layernorm recompute needs Transformer Engine.
"""
from __future__ import annotations

from dcp_megatron.planner.plan import Recompute


def transformer_block(model):
    """The GPT decoder (TransformerBlock) under DDP / Float16 wrappers, or None for models without one."""
    module = model
    while not hasattr(module, "decoder") and hasattr(module, "module"):
        module = module.module
    return getattr(module, "decoder", None)


def decoder_layers(model) -> list:
    """The transformer layers this pipeline stage holds (through DDP / Float16 wrappers)."""
    decoder = transformer_block(model)
    if decoder is None:
        raise ValueError(f"{type(model).__name__} holds no GPT decoder; cannot switch recompute")
    return list(decoder.layers)


def apply_recompute(model, config, recompute: Recompute, *, stage_layers: int | None = None) -> None:
    """none: keep activations; selective: recompute core attention; full k: checkpoint the first k layers.

    `stage_layers`: the layers of the whole pipeline stage when `model` is one of its virtual-stage chunks. The plan
    counts full recompute in the stage's layers; Megatron's block recompute counts in each chunk's (its config is
    shared by the chunks), so k of the stage becomes the same share of every chunk, rounded up."""
    layers = decoder_layers(model)
    stage_layers = stage_layers or len(layers)
    if recompute.kind == "full":
        if recompute.full_layers > stage_layers:
            raise ValueError(f"recompute {recompute} asks for {recompute.full_layers} layers, this stage has "
                             f"{stage_layers}")
        config.recompute_granularity = "full"
        config.recompute_method = "block"
        config.recompute_num_layers = -(-recompute.full_layers * len(layers) // stage_layers)
    else:
        config.recompute_granularity = None
        config.recompute_method = None
        config.recompute_num_layers = None
    for layer in layers:
        layer.self_attention.checkpoint_core_attention = recompute.kind == "selective"


def snapshot_recompute(model_chunks, config) -> tuple:
    """The run's own recompute settings, to put back after a DCP step (evaluation uses them)."""
    flags = [layer.self_attention.checkpoint_core_attention
             for chunk in model_chunks for layer in decoder_layers(chunk)]
    return (config.recompute_granularity, config.recompute_method, config.recompute_num_layers, flags)


def restore_recompute(model_chunks, config, saved: tuple) -> None:
    config.recompute_granularity, config.recompute_method, config.recompute_num_layers, flags = saved
    layers = [layer for chunk in model_chunks for layer in decoder_layers(chunk)]
    for layer, flag in zip(layers, flags):
        layer.self_attention.checkpoint_core_attention = flag
