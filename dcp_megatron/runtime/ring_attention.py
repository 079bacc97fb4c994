"""Ring variant of context-parallel attention: K/V blocks passed around the group point to point.

Step t of c: rank r holds the K/V block of group rank (r - t) mod c, attends its local queries to
it and merges the partial result (online softmax), while the block is already on its way to
r + 1. Backward repeats the walk: alongside each K/V block travels a gradient accumulator for it;
after c hops every accumulator is back home holding the sum over all ranks' queries. Memory per
rank: its own K/V plus one block in flight, independent of c (see cp_attention for when to use).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from dcp_megatron.runtime.attention_blocks import (RowMeta, compute_dtype, key_tiles, merge_into, query_tiles,
                                                   tile_backward, tile_forward, tile_mask)
from dcp_megatron.runtime.sharding import LocalShard


class RingAttention(torch.autograd.Function):
    """Causal per-document attention over a group of size >= 2 with ring K/V exchange."""

    @staticmethod
    def forward(ctx, q, k, v, shard: LocalShard, group, scale: float):
        ct = compute_dtype(q.dtype)
        q_meta = RowMeta.of(shard, q.device)
        qc = q.to(ct)
        key_dim = k.shape[-1]
        out = torch.zeros((*q.shape[:2], v.shape[-1]), dtype=ct, device=q.device)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=ct, device=q.device)
        kv = torch.cat([k, v], dim=-1).contiguous()  # [T, Hkv, D + Dv]: one message per hop
        kv_next = torch.empty_like(kv)
        for step in range(shard.cp_size):
            sends = _pass_on(kv, kv_next, group) if step < shard.cp_size - 1 else []
            for q0, q1, k0, k1, mask in _tiles(shard, q_meta, _source_rank(shard, step), q.device):
                tile_out, tile_lse = tile_forward(qc[q0:q1], kv[k0:k1, :, :key_dim].to(ct),
                                                  kv[k0:k1, :, key_dim:].to(ct), mask, scale)
                merge_into(out[q0:q1], lse[q0:q1], tile_out, tile_lse)
            _wait(sends)
            kv, kv_next = kv_next, kv
        out.masked_fill_(~q_meta.valid_mask[:, None, None], 0.0)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.shard, ctx.group, ctx.scale = shard, group, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        shard, group, scale = ctx.shard, ctx.group, ctx.scale
        ct = out.dtype
        q_meta = RowMeta.of(shard, q.device)
        qc = q.to(ct)
        dout = grad_out.to(ct).masked_fill(~q_meta.valid_mask[:, None, None], 0.0)
        delta = (dout * out).sum(-1)
        dq = torch.zeros_like(qc)
        key_dim = k.shape[-1]
        kv = torch.cat([k, v], dim=-1).contiguous()
        kv_next = torch.empty_like(kv)
        dkv = torch.zeros(kv.shape, dtype=ct, device=kv.device)  # gradient of the block currently held
        dkv_next = torch.empty_like(dkv)
        for step in range(shard.cp_size):
            sends = _pass_on(kv, kv_next, group) if step < shard.cp_size - 1 else []
            for q0, q1, k0, k1, mask in _tiles(shard, q_meta, _source_rank(shard, step), q.device):
                tile_dq, tile_dk, tile_dv = tile_backward(qc[q0:q1], kv[k0:k1, :, :key_dim].to(ct),
                                                          kv[k0:k1, :, key_dim:].to(ct), mask, scale, dout[q0:q1],
                                                          out[q0:q1], lse[q0:q1], delta[q0:q1])
                dq[q0:q1] += tile_dq
                dkv[k0:k1, :, :key_dim] += tile_dk
                dkv[k0:k1, :, key_dim:] += tile_dv
            _wait(sends)
            # The accumulator follows its block; after the last step this hop brings each rank its own.
            _wait(_pass_on(dkv, dkv_next, group))
            kv, kv_next = kv_next, kv
            dkv, dkv_next = dkv_next, dkv
        return dq.to(q.dtype), dkv[..., :key_dim].to(k.dtype), dkv[..., key_dim:].to(v.dtype), None, None, None


def _source_rank(shard: LocalShard, step: int) -> int:
    """Group rank whose K/V block this rank holds at `step`."""
    return (shard.cp_rank - step) % shard.cp_size


def _tiles(shard: LocalShard, q_meta: RowMeta, source_rank: int, device: torch.device):
    """(q0, q1, k0, k1, mask) for local queries against the source rank's rows; empty tiles skipped.

    All ranks share cu_seqlens, so a document's rows have the same range in every rank's block.
    """
    source = shard if source_rank == shard.cp_rank else shard.for_rank(source_rank)
    k_meta = RowMeta.of(source, device)
    cu = shard.cu_seqlens.tolist()
    for q0, q1, d0, d1 in query_tiles(shard):
        for k0, k1 in key_tiles(cu[d0], cu[d1]):
            mask = tile_mask(q_meta.rows(q0, q1), k_meta.rows(k0, k1))
            if bool(mask.any()):
                yield q0, q1, k0, k1, mask


def _pass_on(send: torch.Tensor, recv: torch.Tensor, group) -> list:
    """Send to the next group rank and receive from the previous one, both in flight together."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    next_rank = dist.get_global_rank(group, (rank + 1) % size)
    prev_rank = dist.get_global_rank(group, (rank - 1) % size)
    ops = [dist.P2POp(dist.isend, send, next_rank, group), dist.P2POp(dist.irecv, recv, prev_rank, group)]
    return dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for work in works:
        work.wait()
