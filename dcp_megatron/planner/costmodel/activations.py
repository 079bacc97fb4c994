"""Bytes a transformer layer keeps for backward per local token, per tensor, for a model: its ActivationSpec's count.

One memory model: every shape is counted by memory_spec.py with `ModelShape.activation_spec` (its own spec, else
its transformer_impl's default: TE's for a GPU run). Here are the per-model questions the cost model and the relief
menu ask (what a relief frees, what an offload moves), answered from that count.

Offload (fine-grained activation offloading) moves a module's input to the host: `core_attn` q, k, v and the
softmax statistics (and copies the attention output, which linear_proj still holds); `attn_proj` the attention
output (needs `core_attn`); `expert_fc1` the experts' input; `moe_act` the activation's input.
"""
from __future__ import annotations

from dcp_megatron.planner.costmodel.memory_spec import spec_freed_by_recompute, spec_layer_tensors, spec_mtp_extra_bytes
from dcp_megatron.planner.costmodel.model import ModelShape


def layer_tensors(m: ModelShape) -> dict[str, float]:
    """Bytes per local token per layer on one TP rank, by tensor name (memory_spec.py)."""
    return spec_layer_tensors(m, m.activation_spec)


def full_layer_bytes(m: ModelShape) -> float:
    """A fully recomputed layer keeps its input (the residual stream) per local token."""
    return m.activation_spec.dtype_bytes * m.hidden_size / (m.tp if m.sequence_parallel else 1)


def mtp_layer_bytes(m: ModelShape) -> float:
    """Bytes per local token one MTP layer keeps for backward besides its output layer: its transformer layer (no
    relief counted: an upper bound), its norms and its projection's input (memory_spec.py)."""
    return float(sum(layer_tensors(m).values())) + spec_mtp_extra_bytes(m, m.activation_spec)


def freed_by_recompute(m: ModelShape, module: str) -> frozenset[str]:
    """Tensors of `layer_tensors` one recompute module frees (empty: a no-op for this model and spec)."""
    return spec_freed_by_recompute(m, m.activation_spec, module)[0]


def kept_by_recompute(m: ModelShape, module: str) -> dict[str, float]:
    """Tensors a recompute module's checkpoint keeps that the plain forward does not (memory_spec.py)."""
    return spec_freed_by_recompute(m, m.activation_spec, module)[1]


def freed_by_offload(m: ModelShape, module: str) -> frozenset[str]:
    """Tensors of `layer_tensors` offloading one module's input moves to the host: the core_attn group holds
    every tensor the kernel saves, q, k, v and the LSE (the output stays with linear_proj)."""
    names = {"core_attn": {"core_attn_in", "attn_lse"}, "attn_proj": {"attn_out"}}
    if m.is_moe:
        names.update(expert_fc1={"expert_fc1_in"}, moe_act={"expert_fc1_out"})
    return frozenset(names.get(module, ()))


def moved_by_offload(m: ModelShape, module: str) -> frozenset[str]:
    """Tensors of `layer_tensors` offloading one module copies to the host and back (what costs host-link time).
    `core_attn`'s group copies every tensor core attention saves: q, k, v (released on the GPU) and its output,
    which stays on the GPU too while linear_proj keeps it as its input, unless `attn_proj` offloads that
    (attention.py: `group_offload(core_attn_out, forced_released_tensors=[query, key, value])`)."""
    moved = set(freed_by_offload(m, module))
    if module == "core_attn":
        moved.add("attn_out")
    return frozenset(moved)
