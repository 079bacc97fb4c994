"""Context-parallel core attention over any process group, on packed (THD) zig-zag shards.

`cp_attention(q, k, v, shard, group, impl=...)` computes, for this rank's local query rows, causal
attention inside each document over the document's keys held by the whole group. Two variants:

- "allgather" (default): one all-gather of the group's K and V in forward; backward computes the
  gradients of all gathered keys and reduce-scatters them back to their owners. Per rank it holds
  the group's whole K/V (c x local size) from forward to backward. Use it for the usual CP sizes
  (c <= 8 inside a node): one collective each way per layer, the simplest and fastest when it fits.
- "ring": K/V blocks travel rank to rank with point-to-point sends, partial results are merged
  with the online-softmax rule, and backward sends the K/V blocks around again with their
  gradient accumulators. Per rank it only ever holds two K/V blocks, so use it when c is large
  (long documents across nodes) and the gathered K/V would not fit next to the activations.
- "ulysses": all-to-all from sequence shards to head shards, attention on whole documents for H/c
  heads, all-to-all back (ulysses_attention.py); the group size must divide the query heads.

Positions and document ids of the other ranks' rows are never sent: every rank recomputes them
from the shard layout (`LocalShard.for_rank`). Padding query rows output zeros and padding keys
are never attended to, so padding cannot leak into the loss.

The math is plain torch (masked matmul softmax on bounded tiles, see attention_blocks), identical
on CPU with gloo and on GPU with NCCL; it keeps only the log-sum-exp between forward and backward.
gloo on CPU supports the tensor all-gather and reduce-scatter (checked on torch 2.13), so no fallback is needed.
"""
from __future__ import annotations

import math
from typing import Iterator

import torch
import torch.distributed as dist

from dcp_megatron.runtime.attention_blocks import (RowMeta, compute_dtype, key_tiles, merge_into, query_tiles,
                                                   tile_backward, tile_forward, tile_mask)
from dcp_megatron.runtime.ring_attention import RingAttention
from dcp_megatron.runtime.sharding import LocalShard
from dcp_megatron.runtime.ulysses_attention import ulysses_attention

IMPLS = ("allgather", "ring", "ulysses")

# torch 2.13 renamed the tensor collectives (*_single); older releases on GPU clusters only have the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: LocalShard,
                 group: "dist.ProcessGroup | None", *, impl: str = "allgather",
                 softmax_scale: float | None = None) -> torch.Tensor:
    """Causal per-document attention of local rows q [T, H, D] over the group's k [T, H_kv, D], v [T, H_kv, Dv]:
    out [T, H, Dv] (Dv may differ from D, as in multi-latent attention)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    group = _checked_group(group, shard)
    _check_shapes(q, k, v, shard)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if impl == "ring" and group is not None:
        return RingAttention.apply(q, k, v, shard, group, scale)
    if impl == "ulysses" and group is not None:
        return ulysses_attention(q, k, v, shard, group, softmax_scale=scale)
    return AllGatherAttention.apply(q, k, v, shard, group, scale)


def packed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
                            softmax_scale: float | None = None) -> torch.Tensor:
    """Single-process reference: causal attention inside each segment of cu_seqlens, autograd only."""
    if q.dim() != 3 or k.shape[:2] != v.shape[:2] or k.shape[0] != q.shape[0] or q.shape[1] % k.shape[1]:
        raise ValueError(f"expected q [T, H, D], k [T, H_kv, D], v [T, H_kv, Dv] with H % H_kv == 0, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    bounds = [int(x) for x in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != q.shape[0] or any(b > e for b, e in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to {q.shape[0]}, got {bounds[:8]}...")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    heads_per_kv = q.shape[1] // k.shape[1]
    ct = compute_dtype(q.dtype)
    outs = []
    for start, end in zip(bounds, bounds[1:]):
        qd = q[start:end].to(ct)
        kd = k[start:end].to(ct).repeat_interleave(heads_per_kv, dim=1)
        vd = v[start:end].to(ct).repeat_interleave(heads_per_kv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qd, kd) * scale
        future = torch.ones(end - start, end - start, dtype=torch.bool, device=q.device).triu(1)
        probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, vd))
    if not outs:
        return q.new_zeros(q.shape)
    return torch.cat(outs).to(q.dtype)


class AllGatherAttention(torch.autograd.Function):
    """K/V all-gathered in forward, their gradients reduce-scattered in backward (group None: local)."""

    @staticmethod
    def forward(ctx, q, k, v, shard: LocalShard, group, scale: float):
        ct = compute_dtype(q.dtype)
        kv_local = torch.cat([k, v], dim=-1).contiguous()  # [T, Hkv, D + Dv]: one collective for both
        if group is not None:
            kv_gathered = kv_local.new_empty((shard.cp_size * kv_local.shape[0], *kv_local.shape[1:]))
            _all_gather(kv_gathered, kv_local, group=group)
        else:
            kv_gathered = kv_local
        natural_index = _natural_index(shard).to(q.device)
        kv_natural = torch.empty_like(kv_gathered)
        kv_natural[natural_index] = kv_gathered  # kept in the input dtype; tiles are upcast one at a time
        q_meta, k_meta = RowMeta.of(shard, q.device), _natural_meta(shard, q.device)
        tiles = list(_allgather_tiles(shard))
        qc = q.to(ct)
        key_dim = k.shape[-1]
        out = torch.zeros((*q.shape[:2], v.shape[-1]), dtype=ct, device=q.device)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=ct, device=q.device)
        for q0, q1, k0, k1 in tiles:
            mask = tile_mask(q_meta.rows(q0, q1), k_meta.rows(k0, k1))
            if not bool(mask.any()):
                continue
            tile_out, tile_lse = tile_forward(qc[q0:q1], kv_natural[k0:k1, :, :key_dim].to(ct),
                                              kv_natural[k0:k1, :, key_dim:].to(ct), mask, scale)
            merge_into(out[q0:q1], lse[q0:q1], tile_out, tile_lse)
        out.masked_fill_(~q_meta.valid_mask[:, None, None], 0.0)
        ctx.save_for_backward(qc, kv_natural, natural_index, out, lse)
        ctx.shard, ctx.group, ctx.scale, ctx.tiles, ctx.key_dim = shard, group, scale, tiles, key_dim
        ctx.input_dtypes = (q.dtype, k.dtype, v.dtype)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        qc, kv_natural, natural_index, out, lse = ctx.saved_tensors
        shard, group, scale, key_dim = ctx.shard, ctx.group, ctx.scale, ctx.key_dim
        q_meta, k_meta = RowMeta.of(shard, qc.device), _natural_meta(shard, qc.device)
        dout = grad_out.to(qc.dtype).masked_fill(~q_meta.valid_mask[:, None, None], 0.0)
        delta = (dout * out).sum(-1)
        dq = torch.zeros_like(qc)
        dkv_natural = torch.zeros(kv_natural.shape, dtype=qc.dtype, device=qc.device)
        for q0, q1, k0, k1 in ctx.tiles:
            mask = tile_mask(q_meta.rows(q0, q1), k_meta.rows(k0, k1))
            if not bool(mask.any()):
                continue
            tile_dq, tile_dk, tile_dv = tile_backward(qc[q0:q1], kv_natural[k0:k1, :, :key_dim].to(qc.dtype),
                                                      kv_natural[k0:k1, :, key_dim:].to(qc.dtype), mask, scale,
                                                      dout[q0:q1], out[q0:q1], lse[q0:q1], delta[q0:q1])
            dq[q0:q1] += tile_dq
            dkv_natural[k0:k1, :, :key_dim] += tile_dk
            dkv_natural[k0:k1, :, key_dim:] += tile_dv
        dkv_gathered = dkv_natural[natural_index]
        if group is not None:
            dkv_local = dkv_gathered.new_empty((dkv_gathered.shape[0] // shard.cp_size, *dkv_gathered.shape[1:]))
            _reduce_scatter(dkv_local, dkv_gathered.contiguous(), op=dist.ReduceOp.SUM, group=group)
        else:
            dkv_local = dkv_gathered
        q_dtype, k_dtype, v_dtype = ctx.input_dtypes
        return (dq.to(q_dtype), dkv_local[..., :key_dim].to(k_dtype), dkv_local[..., key_dim:].to(v_dtype), None, None,
                None)


def _natural_index(shard: LocalShard) -> torch.Tensor:
    """For each row of the rank-major gathered buffer, its row in the natural (unsharded, padded) layout."""
    padded = torch.tensor(shard.padded_lengths, dtype=torch.int64)
    doc_start = torch.cumsum(padded, 0) - padded
    parts = []
    for rank in range(shard.cp_size):
        other = shard if rank == shard.cp_rank else shard.for_rank(rank)
        parts.append(doc_start[other.doc_ids] + other.position_ids)
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def _natural_meta(shard: LocalShard, device: torch.device) -> RowMeta:
    """Row metadata of the natural layout: documents in order, each padded, padding at its end."""
    padded = torch.tensor(shard.padded_lengths, dtype=torch.int64)
    lengths = torch.tensor(shard.doc_lengths, dtype=torch.int64)
    doc_ids = torch.repeat_interleave(torch.arange(len(padded), dtype=torch.int64), padded)
    positions = torch.arange(int(padded.sum()), dtype=torch.int64) - (torch.cumsum(padded, 0) - padded)[doc_ids]
    return RowMeta(doc_ids.to(device), positions.to(device), (positions < lengths[doc_ids]).to(device))


def _allgather_tiles(shard: LocalShard) -> Iterator[tuple[int, int, int, int]]:
    """(q_start, q_end, k_start, k_end): local query rows x natural key rows that may attend."""
    padded = shard.padded_lengths
    doc_start = [0]
    for n in padded:
        doc_start.append(doc_start[-1] + n)
    positions = shard.position_ids
    for q0, q1, d0, d1 in query_tiles(shard):
        k_start, k_end = doc_start[d0], doc_start[d1]
        if d1 - d0 == 1:
            # A piece of one chunk: positions rise along it, keys after its last position are masked anyway.
            last_position = int(positions[q1 - 1])
            k_end = k_start + min(shard.doc_lengths[d0], last_position + 1)
        for k0, k1 in key_tiles(k_start, k_end):
            yield q0, q1, k0, k1


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: LocalShard) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or k.shape[:2] != v.shape[:2]:
        raise ValueError(f"expected q [T, H, D], k [T, H_kv, D] and v [T, H_kv, Dv], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[0] != shard.num_local_tokens or k.shape[0] != shard.num_local_tokens:
        raise ValueError(f"q/k/v have {q.shape[0]}/{k.shape[0]} rows, the shard has {shard.num_local_tokens}")
    if q.shape[1] % k.shape[1] or q.shape[2] != k.shape[2]:
        raise ValueError(f"heads {q.shape[1]} must be a multiple of kv heads {k.shape[1]} and head dims equal "
                         f"({q.shape[2]} vs {k.shape[2]})")


def _checked_group(group, shard: LocalShard):
    """The group to communicate over, or None when the attention is purely local."""
    if group is None:
        if shard.cp_size != 1:
            raise ValueError(f"group is None but the shard is for cp_size={shard.cp_size}")
        return None
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size != shard.cp_size or rank != shard.cp_rank:
        raise ValueError(f"shard is for cp_size={shard.cp_size} cp_rank={shard.cp_rank}, but this rank is "
                         f"{rank} of a group of {size}")
    return None if size == 1 else group
