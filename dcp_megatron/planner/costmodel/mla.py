"""Multi-latent attention's shape (megatron-core 0.19.2's MLASelfAttention): weights and saved tensors.

A layer projects the hidden state down to a query latent (`q_lora_rank`; None: one full query projection) and a
key/value latent plus a shared rotary key part (`kv_lora_rank + qk_pos_emb_head_dim`), then up to every head's
query and key (`qk_head_dim` no-rope + `qk_pos_emb_head_dim` rope dims) and value (`v_head_dim`). Scores use the
q/k head dim, the PV product and the output projection the value head dim; every head has its own key and value
(no grouped query heads).

Saved for backward per token (multi_latent_attention.py, unfused RoPE, no `mla_up_proj` recompute): the q
latent, kept by the q up projection; the down projection's kv output (the latent and the rotary key part: the up
projection's input is a view of it); with `--qk-layernorm` each latent's norm instead (its saved tensors, and its
output the up projection keeps); the up projections' outputs are split and concatenated into contiguous query,
key (the rotary key part expanded over heads) and value, which core attention keeps; the raw up-projected tensors
are freed. The latents are sequence-sharded under sequence parallelism, the heads over tp. Measured with the
local spec on the meta device: exact per layer, with and without a q latent and `--qk-layernorm`.
"""
from __future__ import annotations

from dataclasses import dataclass

FP32 = 4


@dataclass(frozen=True, kw_only=True)
class MlaShape:
    kv_lora_rank: int
    qk_head_dim: int              # the no-rope part of each query / key head
    qk_pos_emb_head_dim: int      # the rope part (one key part shared by all heads)
    v_head_dim: int
    q_lora_rank: int | None = None   # None: the query projected from the hidden state in one matmul
    qk_layernorm: bool = False       # norms on the latents (fused into the up projections)

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"MlaShape.{name} must be a positive int, got {value!r}")
        rank = self.q_lora_rank
        if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0):
            raise ValueError(f"MlaShape.q_lora_rank must be None or a positive int, got {rank!r}")

    @property
    def q_head_dim(self) -> int:
        """A query's (and a key's) head dim: what the scores contract over."""
        return self.qk_head_dim + self.qk_pos_emb_head_dim

    def attn_params(self, hidden_size: int, num_heads: int) -> int:
        """One layer's attention weights: down and up projections and the output projection."""
        q_out = num_heads * self.q_head_dim
        q = (hidden_size * self.q_lora_rank + self.q_lora_rank * q_out if self.q_lora_rank is not None
             else hidden_size * q_out)
        kv_down = hidden_size * (self.kv_lora_rank + self.qk_pos_emb_head_dim)
        kv_up = self.kv_lora_rank * num_heads * (self.qk_head_dim + self.v_head_dim)
        return q + kv_down + kv_up + num_heads * self.v_head_dim * hidden_size

    @property
    def norm_params(self) -> int:
        """The latents' norm weights (`--qk-layernorm`)."""
        return (self.kv_lora_rank + (self.q_lora_rank or 0)) if self.qk_layernorm else 0

    def latent_tensors(self, dtype_bytes: int, seq_split: int, norm_bytes) -> dict[str, float]:
        """Bytes per local token the latents keep on one TP rank (`seq_split`: tp under sequence parallelism).
        Without `qk_layernorm` the up projections keep their inputs: the q latent, and a view of the kv down
        projection's whole output (latent and rope key part). With it each latent's norm keeps what `norm_bytes`
        (of a width) says, in place of the latent (a fused or upcasting norm), and its output for the up projection."""
        d = dtype_bytes
        if self.qk_layernorm:
            widths = {"mla_kv_latent": self.kv_lora_rank, "mla_q_latent": self.q_lora_rank}
            return {name: (norm_bytes(width) + d * width) / seq_split for name, width in widths.items()
                    if width is not None}
        out = {"mla_kv_latent": d * (self.kv_lora_rank + self.qk_pos_emb_head_dim) / seq_split}
        if self.q_lora_rank is not None:
            out["mla_q_latent"] = d * self.q_lora_rank / seq_split
        return out
