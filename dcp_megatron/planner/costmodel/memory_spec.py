"""What a run keeps for backward, tensor by tensor, for the kernels it really runs (`ActivationSpec`).

`ModelShape.activations` names the run's activation dtype and kernels; the counts below were measured with
megatron-core 0.19.2's local spec on the meta device (tools/memcheck.py, docs/cost_model.md "Measured") where the
kernel is one the local spec runs, and read from the sources where it is not (marked "read"). Per local token
and layer on one TP rank, d = the activation dtype's bytes, h hidden, q = heads x head_dim, kv = kv heads x
head_dim, f the FFN width, E experts, k top-k:

- norms: "torch" (the local spec's `torch.rms_norm`, composite off the GPU): an fp32 copy of the input (the input
  itself in fp32), the fp32 normalised tensor and the fp32 1/rms, 8h + 4, the output (d h) kept by the next
  linear; "te" (read: TE's LayerNormLinear / TENorm): its input, its output, 1/rms: 2 d h + 4.
- attention: RoPE'd q and k (d(q + kv)) and v; v is a view of linear_qkv's output (attention.py splits it), so a
  kernel that keeps v as handed keeps the whole q + 2kv block ("flash": flash-attention and our meta stand-in;
  `value_view=False` for a kernel that copies it); the output (d q, kept once: linear_proj keeps it too); the
  log-sum-exp 4 x heads; unfused RoPE ("torch") keeps its bf16 cos and sin for q and for k (4 x head_dim x d).
  Our CPU attention ("cpu", core/core_attention.py at CP 1, measured in fp32): the RoPE'd q, k and v repeated to
  every query head (2 d q), each document's output and their concatenation linear_proj keeps (2 d q), the fp32
  log-sum-exp; k and the qkv block are freed. On a CP group of c (`cp_size`) it keeps the group's K/V gathered
  (c d (k + v) per local token) and their int64 row index (8c) instead of the repeated K/V and the concatenation.
- dense MLP: the norm, fc1's input (the norm's output), fc1's output 2 d f, fc2's input d f; the unfused
  SwiGLU (mlp.py's `glu`) also keeps silu's output and the linear half plus its offset (2 d f).
- MoE (local SequentialMLP, alltoall dispatcher, balanced routing): the norm and its output (the router's
  input), the router's state (fp32 logits' top-k probabilities, int64 indices and routing map, the permuted
  probabilities: 8E + 20k + k d), the experts' permuted input k d h, fc1's outputs 2 k d f, their activations k d f;
  a shared expert of width s (read): fc1's output 2 d s and fc2's input d s, its input being the router's.
"""
from __future__ import annotations

from dataclasses import dataclass

FP32 = 4
INT64 = 8


@dataclass(frozen=True, kw_only=True)
class ActivationSpec:
    dtype_bytes: int = 2          # the run's activation dtype: 2 bf16 / fp16, 4 fp32 (Megatron's default, the CPU runs)
    norm: str = "torch"           # "torch" (local spec) or "te" (Transformer Engine's fused norms)
    rope: str = "torch"           # "torch" (unfused, keeps cos and sin) or "fused"
    swiglu: str = "fused"         # "fused" (bias_swiglu keeps its input) or "unfused" (mlp.py's glu)
    attention: str = "flash"      # "flash" (q, k, v, O, LSE) or "cpu" (our PackedCoreAttention)
    value_view: bool = True       # the attention keeps v as a view of linear_qkv's whole output
    fp8_linears: bool = False     # TE's Float8 linears (--fp8-format) keep their input quantized, 1 B (read)
    cp_size: int = 1              # the micro-batch's CP group: only our CPU attention keeps per-group tensors

    def __post_init__(self) -> None:
        choices = {"dtype_bytes": (2, 4), "norm": ("torch", "te"), "rope": ("torch", "fused"),
                   "swiglu": ("fused", "unfused"), "attention": ("flash", "cpu"), "value_view": (True, False),
                   "fp8_linears": (True, False)}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"ActivationSpec.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.fp8_linears and self.norm != "te":
            raise ValueError("ActivationSpec.fp8_linears counts Transformer Engine's FP8 linears: set norm='te' too")
        if not isinstance(self.cp_size, int) or self.cp_size < 1:
            raise ValueError(f"ActivationSpec.cp_size must be a positive int, got {self.cp_size!r}")


# What megatron-core's TE spec keeps, read from Transformer Engine's sources (docs/cost_model.md), not measured:
# LayerNormLinear's input, output and 1/rms; fused RoPE; FusedAttnFunc's q, k, v (TE copies megatron-core's
# strided v, so the qkv block is freed), output and softmax statistics
TRANSFORMER_ENGINE = ActivationSpec(norm="te", rope="fused", swiglu="fused", attention="flash", value_view=False)
# The same under --fp8-format (read from TE's Linear / LayerNormLinear / GroupedLinear, not measured): each linear
# saves its input quantized for the weight gradient, 1 B per element (and a per-tensor fp32 scale), instead of the
# bf16 tensor; linear_proj's is a copy beside the bf16 output the attention kernel keeps
TRANSFORMER_ENGINE_FP8 = ActivationSpec(norm="te", rope="fused", swiglu="fused", attention="flash", value_view=False,
                                        fp8_linears=True)
# What tools/memcheck.py measured: the local spec in bf16 with a flash-attention kernel
LOCAL_BF16 = ActivationSpec(norm="torch", rope="torch", swiglu="fused", attention="flash", value_view=True)
# What our CPU runs are (fp32, the local spec, core/core_attention.py; SwiGLU through megatron-core's bias_swiglu
# function, fused unless --no-bias-swiglu-fusion), measured on a real --dcp run's micro-batches
# (tests/integration/test_memory_count.py)
CPU_FP32 = ActivationSpec(dtype_bytes=4, norm="torch", rope="torch", swiglu="fused", attention="cpu", value_view=True)


def _norm(spec: ActivationSpec, hidden: float) -> float:
    """A norm's own saved bytes per token (its output is counted where the next linear keeps it)."""
    return 2 * FP32 * hidden + FP32 if spec.norm == "torch" else spec.dtype_bytes * hidden + FP32


def attention_widths(m) -> tuple[int, int, int, int]:
    """(query, key, value, output) widths per token over all heads as the kernel keeps them: q and k at the q/k head
    dim (MLA's no-rope + rope dims), v and the output at the kernel's value head dim; a value padded to the q/k dim
    (MLA, THD) has its output trimmed after the kernel, a copy linear_proj keeps besides (`trimmed_output_width`)."""
    heads, kv_heads, v = m.num_heads, m.num_kv_heads, m.kernel_value_head_dim
    return heads * m.score_head_dim, kv_heads * m.score_head_dim, kv_heads * v, heads * v


def trimmed_output_width(m) -> int:
    """Width per token of the attention output linear_proj keeps apart from the kernel's: MLA's padded THD output
    trimmed to the value head dim and reshaped (a copy); 0 when the kernel's output is linear_proj's input."""
    return m.num_heads * m.value_head_dim if m.kernel_value_head_dim != m.value_head_dim else 0


def _value_view(m, spec: ActivationSpec) -> bool:
    """Whether the kept v is a view of linear_qkv's whole output: MLA splits v off the kv up projection's output
    and copies it (`value.contiguous()`), freeing that output."""
    return spec.value_view and m.mla is None


def spec_layer_tensors(m, spec: ActivationSpec) -> dict[str, float]:
    """Bytes per local token per layer on one TP rank, by tensor name (the module docstring)."""
    d, tp = spec.dtype_bytes, m.tp
    lin = 1 if spec.fp8_linears else d      # what a linear keeps of its input per element
    sp = tp if m.sequence_parallel else 1
    h = m.hidden_size
    q, k, v, o = attention_widths(m)
    out = {"attn_norm_in": _norm(spec, h) / sp, "qkv_in": lin * h / sp}
    if m.mla is not None:
        out.update(m.mla.latent_tensors(d, sp, lambda width: _norm(spec, width)))
    if spec.rope == "torch":     # MLA ropes only the rope part of its heads
        out["rope_tables"] = 4 * (m.mla.qk_pos_emb_head_dim if m.mla is not None else m.head_dim) * d
    if spec.attention == "flash":
        # linear_proj's input is the kernel's output (kept once) unless trimmed (a copy) or quantized (FP8 copy)
        proj_in = lin * (trimmed_output_width(m) or o) if spec.fp8_linears else d * trimmed_output_width(m)
        out.update(core_attn_in=d * (q + k + (q + k + v if _value_view(m, spec) else v)) / tp,
                   attn_out=(d * o + proj_in) / tp, attn_lse=FP32 * m.num_heads / tp)
    elif spec.cp_size == 1:
        # ours (CP 1): q, and k and v repeated to every query head; each document's output and the concatenation
        out.update(core_attn_in=d * q / tp, attn_kv_copy=d * (q + o) / tp, attn_out=2 * d * o / tp,
                   attn_lse=FP32 * m.num_heads / tp)
    else:
        # ours on a CP group of c: q, the group's K/V gathered and their row index (rows, not heads), the output
        c = spec.cp_size
        out.update(core_attn_in=d * q / tp, attn_kv_copy=c * d * (k + v) / tp, attn_kv_index=INT64 * c,
                   attn_out=d * o / tp, attn_lse=FP32 * m.num_heads / tp)
    out["mlp_norm_in"] = _norm(spec, h) / sp
    glu = 2 if spec.swiglu == "unfused" and m.gated_mlp else 0
    if m.is_moe:
        width, k, e = (m.moe_ffn_hidden_size or m.ffn_hidden_size), m.moe_topk, m.num_experts
        out.update(router_in=d * h / sp, router_state=INT64 * e + 20 * k + k * d,
                   expert_fc1_in=k * lin * h / tp, expert_fc1_out=k * d * (2 if m.gated_mlp else 1) * width / tp,
                   expert_fc2_in=k * (lin + d * glu) * width / tp)
        if m.moe_shared_expert_size:     # its fc1 reads the router's input (kept once; under FP8 its own copy)
            shared = m.moe_shared_expert_size
            out.update(shared_fc1_out=d * (2 if m.gated_mlp else 1) * shared / tp,
                       shared_fc2_in=(lin + d * glu) * shared / tp)
            if spec.fp8_linears:
                out["shared_fc1_in"] = lin * h / sp
    else:
        out.update(fc1_in=lin * h / sp, fc1_out=d * (2 if m.gated_mlp else 1) * m.ffn_hidden_size / tp,
                   fc2_in=(lin + d * glu) * m.ffn_hidden_size / tp)
    return out


def spec_freed_by_recompute(m, spec: ActivationSpec, module: str) -> tuple[frozenset[str], dict[str, float]]:
    """(tensors of `spec_layer_tensors` one recompute module frees, tensors its checkpoint keeps instead)."""
    d, sp = spec.dtype_bytes, (m.tp if m.sequence_parallel else 1)
    q, k, v, o = attention_widths(m)
    if module == "core_attn":
        if spec.attention == "flash":     # q, k, v stay as the checkpoint's inputs, the output with linear_proj
            return frozenset({"attn_lse"}), {}
        # ours keeps copies; the checkpoint keeps q, k and v (the whole qkv block) and linear_proj the output
        kept = {"attn_ckpt_qkv": d * (q + k + (q + k + v if _value_view(m, spec) else v)) / m.tp,
                "attn_ckpt_out": d * o / m.tp}
        return frozenset({"core_attn_in", "attn_kv_copy", "attn_kv_index", "attn_out", "attn_lse"}), kept
    if module == "mlp" and not m.is_moe:  # TE's fc1 holds the norm (read): the checkpoint frees its output too
        return frozenset({"fc1_out", "fc2_in"} | ({"fc1_in"} if spec.norm == "te" else set())), {}
    if module == "layernorm" and spec.norm == "te":
        # read: a dense layer's norms are fused into the linears (IdentityOps, nothing to recompute); an MoE
        # layer's pre-MLP norm is its own module (the router reads it): its output goes, its input stays held
        return frozenset({"router_in"} if m.is_moe else ()), {}
    if module == "layernorm":             # read: CheckpointWithoutOutput keeps the norm's input, drops its output
        names = {"attn_norm_in", "qkv_in", "mlp_norm_in"} | ({"router_in"} if m.is_moe else {"fc1_in"})
        return frozenset(names), {"norm_ckpt_in": 2 * d * m.hidden_size / sp}
    if module == "moe_act" and m.is_moe:
        return frozenset({"expert_fc2_in"}), {}
    if module == "moe" and m.is_moe:
        return frozenset({"router_state", "expert_fc1_in", "expert_fc1_out", "expert_fc2_in", "shared_fc1_in",
                          "shared_fc1_out", "shared_fc2_in"}), {}
    return frozenset(), {}


def spec_gradient_bytes(m, spec: ActivationSpec) -> tuple[float, float]:
    """(beside the tensors a layer's backward recomputes, beside none) bytes per local token of its gradients at
    their peak: a dense MLP's backward holds the gradients of fc1's output and of the layer's input and output
    (2f + 2h wide) while its recomputed tensors are alive; the torch norm's backward, once they are freed, four
    fp32 hidden-wide tensors (TE's read as two d-typed ones). An MoE layer's: the gradient of its top-k expert
    outputs (k h) and one expert's fc1-output and fc2-input gradients for its k/E share of the rows (the local
    spec's SequentialMLP runs the experts one at a time). Measured on the meta stack (tools/memcheck.py)."""
    d, sp = spec.dtype_bytes, (m.tp if m.sequence_parallel else 1)
    norm = 4 * FP32 * m.hidden_size / sp if spec.norm == "torch" else 2 * d * m.hidden_size / sp
    if m.is_moe:      # the experts' summed output's gradient, and one expert's (local: one at a time) rows
        width, k = (m.moe_ffn_hidden_size or m.ffn_hidden_size), m.moe_topk
        mlp = d * k * (m.hidden_size + 3 * width / m.num_experts) / m.tp
    else:
        mlp = d * (2 * m.ffn_hidden_size / m.tp + 2 * m.hidden_size / sp)
    return mlp, norm


def spec_rope_table_bytes(m) -> float:
    """Bytes per local token fully recomputed layers keep once between them: GPTModel's fp32 RoPE table (one
    head_dim row per position of the longest document, an input of every checkpoint): at most one row per token
    of the micro-batch, c per local token on a CP group of c."""
    return FP32 * m.head_dim * (m.activations.cp_size if m.activations is not None else 1)


def spec_output_bytes(m, spec: ActivationSpec) -> tuple[float, float]:
    """(bytes per vocab/tp unit, bytes per token) the output layer and loss add at their peak: the logits (d) and
    the cross entropy's fp32 copy (none in fp32: `.float()` returns the logits); the final norm, the output
    layer's input and the decoder's input GPTModel still holds (in fp32 that input is the first layer's norm
    input, counted there), and the loss's int64 labels."""
    d = spec.dtype_bytes
    per_vocab = d + (FP32 if d < FP32 else 0)
    sp = m.tp if m.sequence_parallel else 1
    held_inputs = 2 if d < FP32 else 1
    per_token = (_norm(spec, m.hidden_size) + held_inputs * d * m.hidden_size) / sp + INT64 + FP32
    return per_vocab, per_token


def spec_mtp_extra_bytes(m, spec: ActivationSpec) -> float:
    """Bytes per local token an MTP layer keeps beside its transformer layer and its output layer
    (multi_token_prediction.py): the embedding's and the hidden state's norms, and the projection's input, the two
    normed tensors concatenated (2h)."""
    sp = m.tp if m.sequence_parallel else 1
    return (2 * _norm(spec, m.hidden_size) + 2 * spec.dtype_bytes * m.hidden_size) / sp
