"""Bytes a transformer layer keeps for backward per local token, per tensor, as megatron-core 0.19.2 holds them.

Read from megatron-core 0.19.2 (transformer/transformer_layer.py, mlp.py, attention.py,
extensions/transformer_engine.py, tensor_parallel/random.py) for a pre-norm GPT layer, bf16 activations,
hidden dropout 0 (Llama-like; a dropout mask would add 1 B per hidden element):

- attention side: the input norm keeps its input (the residual stream; TE's LayerNormLinear saves its input
  and the norm's output, the local spec's norm and linear_qkv save the same two tensors); core attention keeps
  q, k, v after RoPE and its output (which linear_proj keeps as its input too: one tensor) and the softmax LSE
  (fp32 per head). Our CPU attention (runtime/cp_attention.py, local spec) also keeps its own copy of K/V
  (`kv_natural`; the all-gathered K/V of the group under CP, counted here at one rank's share).
- multi-latent attention (planner/mla.py): q and k at the q/k head dim, v and the output at the value head dim
  the kernel runs (THD pads values to the q/k dim on the GPU: multi_latent_attention.py; our CPU attention drops
  the padding), linear_proj's trimmed copy of a padded output, the kv down projection's output and the q latent; an MTP layer (`mtp_layer_bytes`) adds a layer, its norms
  and its projection's input on the last stage, beside its logits (cost_memory.py).
- MLP side (dense): the pre-MLP norm keeps its input, linear_fc1 its input (the norm's output), the SwiGLU
  its input (fc1's output, 2·ffn wide), linear_fc2 its input (the activation's output, ffn wide).
- MoE layer: the pre-MLP norm is a real module under either spec (the router reads its output): its input and
  output; each token's top-k copies at the experts: expert fc1 input (hidden), fc1 output (2·moe ffn), the
  activation's output (moe ffn).
- With sequence parallelism the residual-stream tensors (norm inputs and outputs) are split over tp; without
  it they are whole on every TP rank. Everything else is split over tp (heads, ffn columns).
- Full recompute of a layer keeps its input only (the residual stream), plus, while it reruns, one layer's
  working set (cost.py).

Module relief frees (transformer_layer.py / attention.py): `core_attn` recompute keeps q, k, v as the
checkpoint's inputs and the output stays with linear_proj, so it frees the LSE (TE fused: ~0) and our CPU
attention's K/V copy; `mlp` (dense only) checkpoints the MLP from its input: under TE (the norm fused into
fc1, pre_mlp_layernorm is an IdentityOp) fc1's input, fc1's output and fc2's input, under the local spec fc1's
and fc2's outputs-as-inputs past the norm; `layernorm` discards the norms' outputs (a no-op under TE for dense
layers: both norms are IdentityOps; for an MoE layer the pre-MLP norm's output); `moe_act` discards the expert
activation's output; `moe` checkpoints the MoE layer from its input. Offload (fine-grained activation
offloading) moves a module's input to the host: `core_attn` q, k, v (and copies the attention output, which
linear_proj still holds); `attn_proj` the attention output (needs `core_attn`); `expert_fc1` the experts' input;
`moe_act` the activation's input.
"""
from __future__ import annotations

from dcp_megatron.planner.memory_spec import (attention_widths, spec_freed_by_recompute, spec_layer_tensors,
                                              spec_mtp_extra_bytes, trimmed_output_width)
from dcp_megatron.planner.model import ModelShape

BF16 = 2
FP32 = 4


def layer_tensors(m: ModelShape) -> dict[str, float]:
    """Bytes per local token per layer on one TP rank, by tensor name (see the module docstring; a shape with its
    own `activations` is counted by memory_spec.py)."""
    if m.activations is not None:
        return spec_layer_tensors(m, m.activations)
    tp = m.tp
    hs = BF16 * m.hidden_size / (tp if m.sequence_parallel else 1)     # a residual-stream-shaped tensor
    q, k, v, o = attention_widths(m)
    out = {"attn_norm_in": hs, "qkv_in": hs, "core_attn_in": BF16 * (q + k + v) / tp,
           "attn_out": BF16 * (o + trimmed_output_width(m)) / tp, "attn_lse": FP32 * m.num_heads / tp}
    if m.mla is not None:
        # a latent's norm fused into its up projection (TE's LayerNormLinear): its input and 1/rms
        out.update(m.mla.latent_tensors(BF16, tp if m.sequence_parallel else 1, lambda width: BF16 * width + FP32))
    if m.transformer_impl == "local":
        out["attn_kv_copy"] = BF16 * (k + v) / tp
    out["mlp_norm_in"] = hs
    if m.is_moe:
        width, k = (m.moe_ffn_hidden_size or m.ffn_hidden_size), m.moe_topk
        out.update(router_in=hs, expert_fc1_in=k * BF16 * m.hidden_size / tp,
                   expert_fc1_out=k * BF16 * (2 if m.gated_mlp else 1) * width / tp,
                   expert_fc2_in=k * BF16 * width / tp)
    else:
        out.update(fc1_in=hs, fc1_out=BF16 * (2 if m.gated_mlp else 1) * m.ffn_hidden_size / tp,
                   fc2_in=BF16 * m.ffn_hidden_size / tp)
    return out


def full_layer_bytes(m: ModelShape) -> float:
    """A fully recomputed layer keeps its input (the residual stream) per local token."""
    width = m.activations.dtype_bytes if m.activations is not None else BF16
    return width * m.hidden_size / (m.tp if m.sequence_parallel else 1)


def mtp_layer_bytes(m: ModelShape) -> float:
    """Bytes per local token one MTP layer keeps for backward besides its output layer: its transformer layer (no
    relief counted: an upper bound), the embedding's and the hidden state's norm inputs and the projection's 2h
    input (the module docstring's table for the norms)."""
    if m.activations is not None:
        extra = spec_mtp_extra_bytes(m, m.activations)
    else:
        extra = 4 * BF16 * m.hidden_size / (m.tp if m.sequence_parallel else 1)
    return float(sum(layer_tensors(m).values())) + extra


def freed_by_recompute(m: ModelShape, module: str) -> frozenset[str]:
    """Tensors of `layer_tensors` one recompute module frees (empty: a no-op for this model and spec)."""
    if m.activations is not None:
        return spec_freed_by_recompute(m, m.activations, module)[0]
    te = m.transformer_impl == "transformer_engine"
    if module == "core_attn":
        return frozenset({"attn_lse"} | ({"attn_kv_copy"} if not te else set()))
    if module == "mlp" and not m.is_moe:
        return frozenset({"fc1_in", "fc1_out", "fc2_in"} if te else {"fc1_out", "fc2_in"})
    if module == "layernorm":
        if m.is_moe:
            return frozenset({"router_in"} | (set() if te else {"qkv_in"}))
        return frozenset() if te else frozenset({"qkv_in", "fc1_in"})
    if module == "moe_act" and m.is_moe:
        return frozenset({"expert_fc2_in"})
    if module == "moe" and m.is_moe:
        return frozenset({"expert_fc1_in", "expert_fc1_out", "expert_fc2_in"})
    return frozenset()


def kept_by_recompute(m: ModelShape, module: str) -> dict[str, float]:
    """Tensors a recompute module's checkpoint keeps that the plain forward does not (memory_spec.py)."""
    return spec_freed_by_recompute(m, m.activations, module)[1] if m.activations is not None else {}


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
