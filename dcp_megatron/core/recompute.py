"""Switch a megatron-core model's activation recompute per micro-batch (docs/megatron.md).

Full (block) recompute is read from the TransformerConfig at every forward, and all modules of a model chunk share
one config object, so setting `recompute_granularity/method/num_layers` right before a micro-batch's forward is
enough (also inside 1F1B: the checkpoint records what it wraps when the forward runs). Each chunk's own: with
virtual pipeline stages megatron.training builds every chunk from its own config (`core_transformer_config_from_args`
per chunk), so the schedule's config (chunk 0's) is not the others'; a switch set there alone left every later
chunk without the full recompute its plan counted.

Module recompute (megatron-core's `recompute_granularity="selective"` with `recompute_modules`) is decided per
module at construction, from the config, into one attribute each module reads at every forward
(megatron-core 0.19.2): `Attention.checkpoint_core_attention` ("core_attn"), `TransformerLayer.recompute_mlp`
("mlp", dense layers), `MoELayer.moe_layer_recompute` ("moe") and `.shared_experts_recompute` ("shared_experts"),
the experts' `activation_recompute` ("moe_act"), `TransformerLayer.recompute_input_layernorm` /
`recompute_pre_mlp_layernorm` ("layernorm"). DCP sets those attributes before each micro-batch's forward, on every
TP rank and stage alike. "moe_act" and "layernorm" run through `CheckpointWithoutOutput`, which needs Transformer
Engine (its FP8 state): GPU only; under the TE spec the norms are fused into the linears, so "layernorm" frees
nothing there.
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


# The recompute modules that run through CheckpointWithoutOutput, which needs Transformer Engine.
NEEDS_TRANSFORMER_ENGINE = frozenset({"moe_act", "layernorm"})


def modules_of(recompute: Recompute) -> frozenset[str]:
    """The megatron-core modules a micro-batch's recompute checkpoints (a plan's "selective" is core attention)."""
    return recompute.modules if recompute.kind == "selective" else frozenset()


def modules_name(modules) -> str:
    """A module set named as the plan names it: "none", "selective" (core attention alone), else e.g. "core_attn+mlp"."""
    return str(Recompute.of_modules(modules))


def modules_on(layers) -> frozenset[str] | None:
    """The recompute modules every one of `layers` has switched on (None when the layers disagree)."""
    on = [{name for module, attribute, name in _switches([layer]) if getattr(module, attribute, False)}
          for layer in layers]
    return frozenset(on[0]) if on and all(s == on[0] for s in on) else (frozenset() if not on else None)


def _switches(layers) -> list[tuple[object, str, str]]:
    """(module, attribute, recompute module name) of every module recompute switch of these layers."""
    out = []
    for layer in layers:
        out.append((layer.self_attention, "checkpoint_core_attention", "core_attn"))
        mlp = layer.mlp
        if getattr(layer, "is_moe_layer", False):
            out.append((mlp, "moe_layer_recompute", "moe"))
            out.append((mlp, "shared_experts_recompute", "shared_experts"))
            if hasattr(mlp.experts, "activation_recompute"):
                out.append((mlp.experts, "activation_recompute", "moe_act"))
        else:
            out.append((layer, "recompute_mlp", "mlp"))
        out.append((layer, "recompute_input_layernorm", "layernorm"))
        out.append((layer, "recompute_pre_mlp_layernorm", "layernorm"))
    return out


def block_config(model):
    """The TransformerConfig the model chunk's decoder reads its full recompute from at each forward."""
    decoder = transformer_block(model)
    if decoder is None:
        raise ValueError(f"{type(model).__name__} holds no GPT decoder; cannot switch recompute")
    return decoder.config


def apply_recompute(model, recompute: Recompute, *, stage_layers: int | None = None) -> None:
    """none: keep activations; module recompute: checkpoint those modules in every layer; full k: checkpoint the
    first k layers. Set on the chunk's own config and modules (module docstring).

    `stage_layers`: the layers of the whole pipeline stage when `model` is one of its virtual-stage chunks. The plan
    counts full recompute in the stage's layers; Megatron's block recompute counts in each chunk's, so k of the
    stage becomes the same share of every chunk, rounded up."""
    layers = decoder_layers(model)
    config = block_config(model)
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
    modules = modules_of(recompute)
    for module, attribute, name in _switches(layers):
        if name == "layernorm" and _is_identity(getattr(module, attribute.replace("recompute_", ""), None)):
            continue   # a fused norm (TE spec): nothing to recompute, and upstream leaves the switch off
        setattr(module, attribute, name in modules)


def _is_identity(norm) -> bool:
    return norm is None or type(norm).__name__ == "IdentityOp"


def snapshot_recompute(model_chunks) -> list[tuple]:
    """The run's own recompute settings of every chunk, to put back after a DCP step (evaluation uses them)."""
    saved = []
    for chunk in model_chunks:
        config = block_config(chunk)
        flags = [getattr(module, attribute, False) for module, attribute, _ in _switches(decoder_layers(chunk))]
        saved.append((config.recompute_granularity, config.recompute_method, config.recompute_num_layers, flags))
    return saved


def restore_recompute(model_chunks, saved: list[tuple]) -> None:
    for chunk, (granularity, method, num_layers, flags) in zip(model_chunks, saved, strict=True):
        config = block_config(chunk)
        config.recompute_granularity, config.recompute_method, config.recompute_num_layers = granularity, method, \
            num_layers
        for (module, attribute, _), flag in zip(_switches(decoder_layers(chunk)), flags, strict=True):
            setattr(module, attribute, flag)
