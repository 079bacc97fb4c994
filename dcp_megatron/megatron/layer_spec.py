"""The GPT block spec we build models from: megatron-core's local spec with two submodules swapped.

- `core_attention` -> `PackedCoreAttention`: packed THD documents (the local
  `DotProductAttention` asserts on `PackedSeqParams`), and the seam where context-parallel
  attention over per-micro-batch groups enters.
- every norm (input, pre-MLP, final) -> `SequenceParallelNorm`: the local spec's
  `WrappedTorchNorm` asserts when sequence parallelism is on. Under sequence parallelism each
  TP rank sees a different slice of the sequence, so norm weight gradients differ per rank;
  marking the parameters `.sequence_parallel = True` makes `finalize_model_grads` all-reduce
  them over the TP group.

On a GPU with Transformer Engine (`attention_backend="te"`), core attention is instead TE's
`TEDotProductAttention`, which takes each micro-batch's CP group from `PackedSeqParams.cp_group`
(or turns CP off for `local_cp_size == 1`); TE's fused THD kernels need bf16/fp16. For FP8
(`attention_backend="te-fp8"`) the whole layer is megatron-core's Transformer Engine spec, whose
TE linear layers are the ones that run in FP8.
"""
from __future__ import annotations

import dataclasses

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from dcp_megatron.megatron.core_attention import PackedCoreAttention

_NORM_CLASSES = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}


class SequenceParallelNorm:
    """Builds a torch LayerNorm/RMSNorm like Megatron's norms, usable with sequence parallelism.

    A class (not a function) because `build_module` only calls types; like Megatron's
    `WrappedTorchNorm`, constructing it returns the torch norm module itself."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: object) -> torch.nn.Module:
        if config.normalization not in _NORM_CLASSES:
            raise ValueError(f"normalization {config.normalization!r} is not one of {sorted(_NORM_CLASSES)}")
        norm = _NORM_CLASSES[config.normalization](hidden_size, eps=eps, dtype=config.params_dtype)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


ATTENTION_BACKENDS = ("local", "te", "te-fp8")


def gpt_block_spec(config: TransformerConfig, num_layers_on_stage: int, *,
                   attention_backend: str = "local") -> TransformerBlockSubmodules:
    """Block spec for the `num_layers_on_stage` layers this pipeline stage builds."""
    if attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend {attention_backend!r} is not one of {ATTENTION_BACKENDS}")
    if attention_backend == "te-fp8":
        from megatron.core.extensions.transformer_engine import TENorm
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return TransformerBlockSubmodules(layer_specs=[get_gpt_layer_with_transformer_engine_spec()] *
                                          num_layers_on_stage, layer_norm=TENorm)
    core_attention = PackedCoreAttention
    if attention_backend == "te":
        from megatron.core.extensions.transformer_engine import TEDotProductAttention
        core_attention = TEDotProductAttention
    layer = get_gpt_layer_local_spec(normalization=config.normalization)
    attention = layer.submodules.self_attention
    attention = dataclasses.replace(
        attention, submodules=dataclasses.replace(attention.submodules, core_attention=core_attention)
    )
    layer = dataclasses.replace(
        layer,
        submodules=dataclasses.replace(
            layer.submodules,
            input_layernorm=SequenceParallelNorm,
            pre_mlp_layernorm=SequenceParallelNorm,
            self_attention=attention,
        ),
    )
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers_on_stage, layer_norm=SequenceParallelNorm)
