"""Layout-independent weight initialisation.

Megatron draws initial weights from one RNG stream in construction order, so the weights a
layer gets depend on which pipeline stage builds it and on the TP rank's seed offset. To
compare runs with different layouts (and to make `--seed` mean one model), every parameter
is drawn here from its own generator, seeded by the run seed and the parameter's *global*
name (decoder layers renamed to their global layer number), at its full unpartitioned
shape; a tensor-parallel rank then keeps its slice exactly as Megatron partitions master
weights (split along `partition_dim` into `stride * tp_size` pieces, rank r takes r::tp).
"""
from __future__ import annotations

import math
import re
import zlib

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

_LAYER_PREFIX = re.compile(r"^(.*decoder\.layers\.)(\d+)(\..*)$")
# Output projections of each residual branch get the depth-scaled init (GPT-2 / Megatron).
_SCALED_INIT_SUFFIXES = ("linear_proj.weight", "linear_fc2.weight")


def global_parameter_names(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Parameters keyed by a name that is the same under every TP/PP layout."""
    layers = getattr(getattr(model, "decoder", None), "layers", [])
    layer_numbers = [layer.layer_number for layer in layers]
    named: dict[str, torch.nn.Parameter] = {}
    for name, param in model.named_parameters():
        match = _LAYER_PREFIX.match(name)
        if match:
            name = f"{match[1]}{layer_numbers[int(match[2])] - 1}{match[3]}"
        # A tied output layer on the last stage is the same weight as the word embeddings.
        if name == "output_layer.weight" and getattr(param, "shared_embedding", False):
            name = "embedding.word_embeddings.weight"
        named[name] = param
    return named


def _seed_for(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def _full_shape(param: torch.nn.Parameter, tp_size: int) -> list[int]:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp_size
    return shape


def _local_slice(full: torch.Tensor, param: torch.nn.Parameter, tp_size: int, tp_rank: int) -> torch.Tensor:
    if not getattr(param, "tensor_model_parallel", False) or tp_size == 1:
        return full
    dim, stride = param.partition_dim, param.partition_stride
    piece = param.shape[dim] // stride
    pieces = torch.split(full, piece, dim=dim)
    return torch.cat(pieces[tp_rank::tp_size], dim=dim)


@torch.no_grad()
def init_weights_by_name(model: torch.nn.Module, config: TransformerConfig, *, seed: int, tp_size: int, tp_rank: int) -> int:
    """Initialise every parameter of `model` in place; returns the number initialised."""
    std = config.init_method_std
    scaled_std = std / math.sqrt(2.0 * config.num_layers)
    named = global_parameter_names(model)
    for name, param in named.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "bias" or leaf.endswith("_bias"):  # TE fuses norms into linears: layer_norm_bias
            param.zero_()
            continue
        if "norm" in name:
            param.fill_(1.0)
            continue
        generator = torch.Generator().manual_seed(_seed_for(seed, name))
        full = torch.empty(_full_shape(param, tp_size), dtype=torch.float32)
        full.normal_(0.0, scaled_std if name.endswith(_SCALED_INIT_SUFFIXES) else std, generator=generator)
        param.copy_(_local_slice(full, param, tp_size, tp_rank))
    return len(named)
