"""A small pure-torch GPT used as the reference for exactness tests and CPU benchmarks.

Llama-shaped: token embedding, pre-norm blocks (RMSNorm -> GQA attention with RoPE -> RMSNorm ->
SwiGLU MLP), final RMSNorm, untied output layer; no biases, no dropout. It knows nothing about
parallelism: the core attention of each micro-batch is the `attention(q, k, v)` callable passed to
forward (e.g. partial(cp_attention, shard=..., group=...) or partial(packed_causal_attention,
cu_seqlens=...)), and RoPE reads the per-document `position_ids`, so packed documents never see
each other and sharded tokens keep their positions.

Recompute is switched per micro-batch by flipping attributes read at every forward:
`block.checkpoint_layer` (checkpoint the whole block), `block.attn.checkpoint_core_attention` (only the core
attention) and `block.checkpoint_mlp` (only the MLP), all with torch.utils.checkpoint(use_reentrant=False).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

_INIT_STD = 0.02


@dataclass(frozen=True, kw_only=True)
class TinyGPTConfig:
    vocab_size: int
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    rope_base: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} must be a multiple of num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} (hidden_size / num_heads) must be even for RoPE")
        if self.rope_base <= 1.0:
            raise ValueError(f"rope_base must be > 1, got {self.rope_base}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_shape(cls, shape) -> "TinyGPTConfig":
        """The TinyGPT of a planner ModelShape (so benchmarks run the model the cost model scores)."""
        if not shape.gated_mlp:
            raise ValueError(f"TinyGPT's MLP is SwiGLU; this shape has gated_mlp=False: {shape}")
        if shape.num_heads * shape.head_dim != shape.hidden_size:
            raise ValueError(f"TinyGPT needs hidden_size = num_heads x head_dim, got {shape}")
        return cls(vocab_size=shape.vocab_size, num_layers=shape.num_layers, hidden_size=shape.hidden_size,
                   num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads, ffn_hidden_size=shape.ffn_hidden_size)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


def apply_rope(x: torch.Tensor, position_ids: torch.Tensor, base: float) -> torch.Tensor:
    """Rotary embedding (rotate-half form) of x [T, heads, D] at the given per-token positions."""
    half = x.shape[-1] // 2
    inv_freq = base ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
    angles = position_ids.to(device=x.device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__()
        self.config = config
        qkv_heads = config.num_heads + 2 * config.num_kv_heads
        self.qkv = nn.Linear(config.hidden_size, qkv_heads * config.head_dim, bias=False)
        self.proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=False)
        self.checkpoint_core_attention = False

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, attention: AttentionFn) -> torch.Tensor:
        cfg = self.config
        q, k, v = self.qkv(x).split([cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim,
                                     cfg.num_kv_heads * cfg.head_dim], dim=-1)
        q = apply_rope(q.reshape(-1, cfg.num_heads, cfg.head_dim), position_ids, cfg.rope_base)
        k = apply_rope(k.reshape(-1, cfg.num_kv_heads, cfg.head_dim), position_ids, cfg.rope_base)
        v = v.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
        if self.checkpoint_core_attention:
            out = checkpoint(attention, q, k, v, use_reentrant=False)
        else:
            out = attention(q, k, v)
        return self.proj(out.reshape(x.shape[0], cfg.num_heads * cfg.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(config.hidden_size, 2 * config.ffn_hidden_size, bias=False)
        self.down = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.hidden_size)
        self.mlp = SwiGLU(config)
        self.checkpoint_layer = False
        self.checkpoint_mlp = False

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, attention: AttentionFn) -> torch.Tensor:
        if self.checkpoint_layer:
            return checkpoint(self._forward, x, position_ids, attention, use_reentrant=False)
        return self._forward(x, position_ids, attention)

    def _forward(self, x: torch.Tensor, position_ids: torch.Tensor, attention: AttentionFn) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), position_ids, attention)
        if self.checkpoint_mlp:
            return x + checkpoint(self.mlp, self.mlp_norm(x), use_reentrant=False)
        return x + self.mlp(self.mlp_norm(x))


class TinyGPT(nn.Module):
    """forward(tokens [T], position_ids [T], attention) -> logits [T, vocab] for one packed micro-batch."""

    def __init__(self, config: TinyGPTConfig, *, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.final_norm = RMSNorm(config.hidden_size)
        self.output = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Deterministic init from one generator: the same seed gives the same model in every process."""
        gen = torch.Generator().manual_seed(seed)
        # Residual-branch outputs are scaled down with depth (GPT-2) so activations stay O(1).
        residual_std = _INIT_STD / math.sqrt(2 * self.config.num_layers)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            std = residual_std if name.endswith(("attn.proj.weight", "mlp.down.weight")) else _INIT_STD
            param.copy_(torch.randn(param.shape, generator=gen) * std)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor, attention: AttentionFn) -> torch.Tensor:
        if tokens.dim() != 1 or tokens.shape != position_ids.shape:
            raise ValueError(f"tokens and position_ids must both be [T], got {tuple(tokens.shape)} and "
                             f"{tuple(position_ids.shape)}")
        x = self.embedding(tokens)
        for block in self.layers:
            x = block(x, position_ids, attention)
        return self.output(self.final_norm(x))
