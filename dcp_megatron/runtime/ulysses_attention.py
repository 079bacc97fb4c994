"""Ulysses context-parallel attention: all-to-all from sequence shards to head shards and back.

The second CP flavour next to all-gather/ring (cp_attention.py), as DeepSpeed-Ulysses computes it, on
the micro-batch's own group. Each rank of a group of c holds its zig-zag rows of the micro-batch for
all heads; one all-to-all per tensor gives every rank all rows of the micro-batch for H/c of the
heads, it runs ordinary causal attention inside each document, and one all-to-all sends the output
rows back to their owners. Autograd: an all-to-all is linear, its backward the reverse all-to-all.

Limits: the group size must divide the query heads; key/value heads are split too when c divides
them, else every rank gets all of them (replicated by GQA repetition before the exchange, which
costs more bytes: the planner's cost model charges it). Communication per layer and pass is q, k,
v and the output, (c-1)/c of this rank's rows each, and nothing hides it behind compute, while the
all-gather flavour receives (c-1) x the local K/V and overlaps it: Ulysses wins for large groups
and GQA models with few KV heads replicated rarely; the planner picks per micro-batch.

The rows arriving from the group are put in document order from the shard layout alone
(`LocalShard.for_rank`), so nothing but the tensors is sent. Padding rows sit after their document's
tokens, so no real token attends to them; their outputs are zeroed, as in the other flavours.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dcp_megatron.planner.costmodel.model import kv_heads_exchanged, ulysses_supported
from dcp_megatron.planner.padding import padded_length
from dcp_megatron.runtime.sharding import LocalShard


class _SequenceToHeads(torch.autograd.Function):
    """[T_local, H, D] (this rank's rows, all heads) -> [c * T_local, H / c, D] (every rank's rows, my heads)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _sequence_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_sequence(grad.contiguous(), ctx.group), None


class _HeadsToSequence(torch.autograd.Function):
    """The inverse exchange: [c * T_local, H / c, D] -> [T_local, H, D]."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _sequence_to_heads(grad.contiguous(), ctx.group), None


def _sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    c = group.size()
    rows, heads, dim = x.shape
    send = x.reshape(rows, c, heads // c, dim).transpose(0, 1).contiguous()   # block j: my rows, rank j's heads
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)                          # block j: rank j's rows, my heads
    return recv.reshape(c * rows, heads // c, dim)


def _heads_to_sequence(y: torch.Tensor, group) -> torch.Tensor:
    c = group.size()
    all_rows, heads, dim = y.shape
    send = y.reshape(c, all_rows // c, heads, dim).contiguous()              # block j: rank j's rows, my heads
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)                          # block j: my rows, rank j's heads
    return recv.transpose(0, 1).reshape(all_rows // c, c * heads, dim)


def _document_order(shard: LocalShard) -> tuple[torch.Tensor, list[int]]:
    """Permutation putting the group's gathered rows (rank 0's rows, rank 1's, ...) in document order, and
    the padded document bounds of that order."""
    padded = [padded_length(n, shard.cp_size, shard.pad_multiple) for n in shard.doc_lengths]
    starts = torch.tensor([0] + padded[:-1], dtype=torch.int64).cumsum(0)
    keys = torch.cat([starts[s.doc_ids] + s.position_ids for s in (shard.for_rank(r) for r in range(shard.cp_size))])
    bounds = [0]
    for n in padded:
        bounds.append(bounds[-1] + n)
    return torch.argsort(keys), bounds


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: LocalShard, group, *,
                      softmax_scale: float | None = None) -> torch.Tensor:
    """Causal per-document attention of local rows q [T, H, D], k [T, H_kv, D], v [T, H_kv, Dv] over the group
    (Ulysses): out [T, H, Dv]."""
    c = shard.cp_size
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    if group is None or c == 1:
        raise ValueError("ulysses_attention needs a CP group of at least 2 ranks")
    if group.size() != c:
        raise ValueError(f"the group has {group.size()} ranks, the shard was cut for {c}")
    if not ulysses_supported(num_heads, num_kv_heads, c):
        raise ValueError(f"Ulysses over {c} ranks needs the {num_heads} query heads to split evenly (and be a "
                         f"multiple of the {num_kv_heads} key/value heads); use the all-gather CP attention")
    if q.shape[0] != shard.num_local_tokens or k.shape[:2] != v.shape[:2] or k.shape[0] != q.shape[0]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match the shard's "
                         f"{shard.num_local_tokens} local rows")
    if kv_heads_exchanged(num_heads, num_kv_heads, c) != num_kv_heads:
        repeat = num_heads // num_kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    order, bounds = _document_order(shard)
    order = order.to(q.device)
    q_all, k_all, v_all = (_SequenceToHeads.apply(x, group).index_select(0, order) for x in (q, k, v))
    repeat = q_all.shape[1] // k_all.shape[1]
    outputs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        # [1, H, L, D]: with a batch dimension SDPA takes the fused kernel on CPU (3-D inputs: the math path)
        qd = q_all[start:end].transpose(0, 1).unsqueeze(0)
        kd = k_all[start:end].repeat_interleave(repeat, dim=1).transpose(0, 1).unsqueeze(0)
        vd = v_all[start:end].repeat_interleave(repeat, dim=1).transpose(0, 1).unsqueeze(0)
        outputs.append(F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale)[0].transpose(0, 1))
    natural = torch.cat(outputs)
    gathered = natural.index_select(0, torch.argsort(order))   # back to rank 0's rows, rank 1's, ...
    out = _HeadsToSequence.apply(gathered.contiguous(), group)
    return out * shard.valid_mask.to(out.device).view(-1, 1, 1).to(out.dtype)
