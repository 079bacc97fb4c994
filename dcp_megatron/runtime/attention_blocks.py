"""Masked attention on tiles of packed documents: the math shared by both CP attention variants.

A tile pairs a contiguous range of query rows with a contiguous range of key rows. Which pairs
may attend is decided only by per-row metadata (document id, position inside the document,
validity), so tiles can cut anywhere and both the all-gather and the ring variant reuse the
same kernels; tiles only bound memory (scores are [heads, tile_q, tile_k]) and skip work.

Forward returns the tile's output and log-sum-exp (LSE) per (row, head); partial results over
different key tiles are merged with the online-softmax rule. Backward recomputes the tile's
probabilities from the final LSE (nothing quadratic is kept between forward and backward),
FlashAttention style: dS = P * (dP - delta), delta = rowsum(dO * O).

Two implementations of the same exact math: on CPU, torch's fused flash-attention kernel for CPU
(`aten::_scaled_dot_product_flash_attention_for_cpu` and its backward, which take an additive mask
and return the LSE) — blocked, vectorised, no [heads, Tq, Tk] score/probability tensors allocated
per tile, ~5-7x faster than the plain version on one core; elsewhere (GPU, or a torch without the
op) plain torch matmul/softmax. Both agree to fp32 rounding.

Shapes: q [Tq, H, D]; k [Tk, Hkv, D]; v [Tk, Hkv, Dv]; query head h reads KV head h // (H // Hkv) (GQA). The
value head dim Dv may differ from the query/key head dim D (multi-latent attention); the output has Dv.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from dcp_megatron.runtime.sharding import LocalShard

# Query rows per tile and key rows per tile: small enough that a tile's score matrix stays a
# few MB per head, large enough that the Python loop over tiles is not the bottleneck.
QUERY_TILE_ROWS = 512
KEY_TILE_ROWS = 2048


@dataclass(frozen=True)
class RowMeta:
    """Per-row metadata of a token block (queries or keys)."""

    doc_ids: torch.Tensor       # int64 [T]
    position_ids: torch.Tensor  # int64 [T]
    valid_mask: torch.Tensor    # bool  [T]

    @staticmethod
    def of(shard: LocalShard, device: torch.device) -> "RowMeta":
        return RowMeta(shard.doc_ids.to(device), shard.position_ids.to(device), shard.valid_mask.to(device))

    def rows(self, start: int, end: int) -> "RowMeta":
        return RowMeta(self.doc_ids[start:end], self.position_ids[start:end], self.valid_mask[start:end])


def tile_mask(q_meta: RowMeta, k_meta: RowMeta) -> torch.Tensor:
    """[Tq, Tk] bool: same document, key not after the query, key not padding."""
    same_doc = q_meta.doc_ids[:, None] == k_meta.doc_ids[None, :]
    causal = k_meta.position_ids[None, :] <= q_meta.position_ids[:, None]
    return same_doc & causal & k_meta.valid_mask[None, :]


def query_tiles(shard: LocalShard) -> Iterator[tuple[int, int, int, int]]:
    """(q_start, q_end, doc_start, doc_end) covering the shard's local rows once.

    Short documents are grouped until a tile holds QUERY_TILE_ROWS rows; a long document's two
    zig-zag chunks are cut separately (their positions are far apart, so their key ranges differ).
    """
    cu = shard.cu_seqlens.tolist()
    doc = 0
    num_docs = shard.num_docs
    while doc < num_docs:
        rows = cu[doc + 1] - cu[doc]
        if rows > QUERY_TILE_ROWS:
            chunk = rows // 2
            for chunk_start in (cu[doc], cu[doc] + chunk):
                for start in range(chunk_start, chunk_start + chunk, QUERY_TILE_ROWS):
                    yield start, min(start + QUERY_TILE_ROWS, chunk_start + chunk), doc, doc + 1
            doc += 1
            continue
        last = doc + 1
        while last < num_docs and cu[last + 1] - cu[doc] <= QUERY_TILE_ROWS:
            last += 1
        yield cu[doc], cu[last], doc, last
        doc = last


def key_tiles(start: int, end: int) -> Iterator[tuple[int, int]]:
    for k0 in range(start, end, KEY_TILE_ROWS):
        yield k0, min(k0 + KEY_TILE_ROWS, end)


def _grouped(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[T, H, D] -> [Hkv, H/Hkv, T, D]."""
    t, h, d = q.shape
    return q.reshape(t, num_kv_heads, h // num_kv_heads, d).permute(1, 2, 0, 3)


def _ungrouped(x: torch.Tensor) -> torch.Tensor:
    """[Hkv, g, T, D] -> [T, H, D]."""
    hkv, g, t, d = x.shape
    return x.permute(2, 0, 1, 3).reshape(t, hkv * g, d)


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _use_fused(q: torch.Tensor) -> bool:
    return (_FLASH_CPU is not None and _FLASH_CPU_BACKWARD is not None and q.device.type == "cpu"
            and q.dtype in (torch.float32, torch.float64))


def _heads_first(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[T, Hx, D] -> [1, num_heads, T, D], KV heads repeated for their query heads (GQA)."""
    if x.shape[1] != num_heads:
        x = x.repeat_interleave(num_heads // x.shape[1], dim=1)
    return x.transpose(0, 1).unsqueeze(0)


def _additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.where(mask, torch.zeros((), dtype=dtype), torch.full((), float("-inf"), dtype=dtype))


def _fused_forward(q, k, v, mask, scale):
    num_heads, value_dim = q.shape[1], v.shape[-1]
    q, k, v = _equal_head_dims(q, k, v)
    out, lse = _FLASH_CPU(_heads_first(q, num_heads), _heads_first(k, num_heads), _heads_first(v, num_heads),
                          attn_mask=_additive_mask(mask, q.dtype), scale=scale)
    lse = lse[0].transpose(0, 1)                                     # [Tq, H]
    # The kernel reports LSE 0 (and output 0) for a row with no allowed key; the merge needs -inf.
    lse = lse.masked_fill(~mask.any(-1, keepdim=True), float("-inf"))
    return out[0].transpose(0, 1)[..., :value_dim], lse


def _fused_backward(q, k, v, mask, scale, grad_out, out, lse):
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    key_dim, value_dim = k.shape[-1], v.shape[-1]
    q, k, v = _equal_head_dims(q, k, v)
    grad_out, out = _zero_padded(grad_out, v.shape[-1]), _zero_padded(out, v.shape[-1])
    dq, dk, dv = _FLASH_CPU_BACKWARD(
        _heads_first(grad_out, num_heads).contiguous(), _heads_first(q, num_heads), _heads_first(k, num_heads),
        _heads_first(v, num_heads), _heads_first(out, num_heads).contiguous(),
        _finite(lse).transpose(0, 1).unsqueeze(0).contiguous(), 0.0, False,
        attn_mask=_additive_mask(mask, q.dtype), scale=scale)
    tk, d = k.shape[0], k.shape[2]
    group = num_heads // num_kv_heads
    dk = dk[0].reshape(num_kv_heads, group, tk, d).sum(1).transpose(0, 1)  # [Tk, Hkv, D]
    dv = dv[0].reshape(num_kv_heads, group, tk, d).sum(1).transpose(0, 1)
    return dq[0].transpose(0, 1)[..., :key_dim], dk[..., :key_dim], dv[..., :value_dim]


def _equal_head_dims(q, k, v):
    """The fused kernel needs one head dim: zero columns appended to q/k (scores unchanged) or to v (output
    columns that are cut off again) give the exact result of unequal dims."""
    dim = max(k.shape[-1], v.shape[-1])
    return _zero_padded(q, dim), _zero_padded(k, dim), _zero_padded(v, dim)


def _zero_padded(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x if x.shape[-1] == dim else torch.nn.functional.pad(x, (0, dim - x.shape[-1]))


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Masked scaled scores [Hkv, g, Tq, Tk] (-inf where masked)."""
    qg = _grouped(q, k.shape[1])
    kt = k.permute(1, 2, 0).unsqueeze(1)  # [Hkv, 1, D, Tk]
    scores = torch.matmul(qg, kt) * scale
    return scores.masked_fill(~mask, float("-inf"))


def tile_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one tile: out [Tq, H, Dv] and LSE [Tq, H] (-inf for rows with no allowed key)."""
    if _use_fused(q):
        return _fused_forward(q, k, v, mask, scale)
    scores = _scores(q, k, mask, scale)
    lse = torch.logsumexp(scores, dim=-1)  # [Hkv, g, Tq]
    probs = torch.exp(scores - _finite(lse).unsqueeze(-1))
    out = torch.matmul(probs, v.permute(1, 0, 2).unsqueeze(1))  # [Hkv, g, Tq, D]
    return _ungrouped(out), lse.permute(2, 0, 1).reshape(q.shape[0], q.shape[1])


def tile_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                  grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                  delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one tile given the rows' final output O [Tq, H, Dv], LSE and delta = rowsum(dO * O) [Tq, H].

    Returns dq [Tq, H, D] (this tile's share), dk [Tk, Hkv, D] and dv [Tk, Hkv, Dv].
    """
    if _use_fused(q):
        return _fused_backward(q, k, v, mask, scale, grad_out, out, lse)
    num_kv_heads = k.shape[1]
    scores = _scores(q, k, mask, scale)
    probs = torch.exp(scores - _grouped(_finite(lse).unsqueeze(-1), num_kv_heads))
    dout = _grouped(grad_out, num_kv_heads)                                    # [Hkv, g, Tq, D]
    dprobs = torch.matmul(dout, v.permute(1, 2, 0).unsqueeze(1))               # [Hkv, g, Tq, Tk]
    dscores = probs * (dprobs - _grouped(delta.unsqueeze(-1), num_kv_heads))
    dq = torch.matmul(dscores, k.permute(1, 0, 2).unsqueeze(1)) * scale        # [Hkv, g, Tq, D]
    dk = torch.matmul(dscores.transpose(-1, -2), _grouped(q, num_kv_heads)).sum(1) * scale  # [Hkv, Tk, D]
    dv = torch.matmul(probs.transpose(-1, -2), dout).sum(1)                    # [Hkv, Tk, D]
    return _ungrouped(dq), dk.permute(1, 0, 2), dv.permute(1, 0, 2)


def merge_into(out_acc: torch.Tensor, lse_acc: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Online-softmax merge of a partial result (out, lse) into the accumulators, in place.

    Rows where both sides saw no key keep LSE -inf and output 0.
    """
    new_lse = torch.logaddexp(lse_acc, lse)
    safe = _finite(new_lse)
    weight_acc = torch.exp(lse_acc - safe).unsqueeze(-1)
    weight_new = torch.exp(lse - safe).unsqueeze(-1)
    out_acc.copy_(out_acc * weight_acc + out * weight_new)
    lse_acc.copy_(new_lse)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """LSE with -inf replaced by 0, so exp(-inf - lse) is 0 instead of NaN."""
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulate in at least fp32 (bf16/fp16 inputs), keep fp64 when given fp64."""
    return torch.promote_types(dtype, torch.float32)
