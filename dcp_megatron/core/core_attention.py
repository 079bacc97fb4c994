"""Core attention for packed (THD) documents without Transformer Engine: our `core_attention` seam.

megatron-core's local `DotProductAttention` refuses packed input and context parallelism, so
the layer spec puts this module in its place. It takes exactly the arguments Megatron's
`Attention` passes to any core attention and computes causal attention inside each document
of the packed micro-batch (documents never attend to each other), with grouped-query heads.

Input shapes under THD (Megatron squeezes the batch dimension): query [T, heads, head_dim],
key [T, kv_heads, head_dim], value [T, kv_heads, value_dim]; `packed_seq_params.cu_seqlens_q` gives document
bounds. The output is [T, heads * value_dim], what `Attention` feeds its output projection. Multi-latent
attention builds it with `k_channels`/`v_channels` (value_dim differs from head_dim) and pads THD values to the
query's head dim: the padding columns are dropped before attending and restored as zeros after.

When the params name a CP group (`cp_group` with `local_cp_size > 1`, as Megatron-LM's
`forward_step` builds them from a batch's `cu_seqlens_padded`/`local_cp_size`), the rows are this
rank's zig-zag share of the micro-batch and keys of the other group members are needed: the
runtime's `cp_attention` computes it over that group. A DCP micro-batch's params carry its facts
(`facts_of`, core/microbatch_facts.py): the shard (`attention_shard`, built once per micro-batch from the
padded document lengths, the group's size and this rank's place in it, and shared by every layer and
recompute) and the CP flavour its plan chose (all-gather or Ulysses). Params without facts (not a DCP
micro-batch's) get the all-gather flavour and a shard rebuilt from the params alone at each call
(`shard_from_params`). Padding sits at the end of each document, so treating padded lengths as
document lengths changes no real token's output (causal) and the padding rows are masked out of the loss.

Without packed params (Megatron's default `sbhd` layout, e.g. without
`--dataloader-inter-document-masking`) it is causal attention over each sequence; under Megatron's
own `--context-parallel-size > 1` each sequence arrives zig-zag sharded over Megatron's CP group
(chunks r and 2c-1-r of 2c, `get_batch_on_this_cp_rank`'s per-sequence layout), which is exactly
our layout of one document per sequence, so the same CP attention runs over that group. Megatron's
static CP with packed documents (THD) is refused: it shards whole samples, not documents, a layout
only Transformer Engine's attention implements.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from dcp_megatron.core.microbatch_facts import MicroBatchFacts, facts_of
from dcp_megatron.runtime.cp_attention import cp_attention
from dcp_megatron.runtime.sharding import LocalShard, shard_microbatch


class PackedCoreAttention(MegatronModule):
    """Per-document causal attention over a THD micro-batch (see the module docstring)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
    ) -> None:
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"PackedCoreAttention supports causal masks only, got {attn_mask_type}")
        self.layer_number = layer_number
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        # Multi-latent attention passes its query/key head dim (with the rotary part) and its value head dim.
        key_dim = k_channels if k_channels is not None else config.kv_channels
        self.value_dim = v_channels if v_channels is not None else config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(key_dim)
        # Megatron's own (static) CP group; a DCP micro-batch brings its own group in its params.
        static_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        self.static_cp_group = static_group if static_group is not None and static_group.size() > 1 else None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("PackedCoreAttention does not support attention_bias")
        dropout_p = self.dropout_p if self.training else 0.0
        padded_value_dim = value.shape[-1]
        if padded_value_dim > self.value_dim:
            # MLA pads THD values with zero columns to the query's head dim and cuts the output back: attend with
            # the real columns (less to send over the CP group) and hand back zeros in the padded ones.
            value = value[..., :self.value_dim]
        out = self._attend(query, key, value, packed_seq_params, dropout_p)
        if padded_value_dim == self.value_dim:
            return out
        out = out.reshape(*out.shape[:-1], -1, self.value_dim)
        return F.pad(out, (0, padded_value_dim - self.value_dim)).flatten(-2)

    def _attend(self, query, key, value, packed_seq_params, dropout_p: float) -> torch.Tensor:
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            if self.static_cp_group is not None:
                if self.dropout_p > 0 and self.training:
                    raise ValueError("attention dropout is not supported by the CPU context-parallel attention")
                return sequence_cp_attention(query, key, value, self.static_cp_group, self.softmax_scale)
            return sequence_causal_attention(query, key, value, self.softmax_scale, dropout_p)
        if self.static_cp_group is not None and packed_seq_params.cp_group is None:
            raise ValueError(
                "--context-parallel-size > 1 with packed documents (--dataloader-inter-document-masking): Megatron "
                "shards each sample, not each document, over its CP group, a layout only Transformer Engine's "
                "attention implements; on CPU use --dcp (DCP shards per document) or drop the document masking")
        facts = facts_of(packed_seq_params)
        if facts is None:
            shard, flavour = shard_from_params(packed_seq_params), "allgather"
        else:
            shard, flavour = _checked_shard(facts, packed_seq_params), facts.attention
        if shard is not None:
            if self.dropout_p > 0 and self.training:
                raise ValueError("attention dropout is not supported with DCP context-parallel attention")
            out = cp_attention(query, key, value, shard, packed_seq_params.cp_group, softmax_scale=self.softmax_scale,
                               impl=flavour)
            return out.reshape(out.shape[0], -1)
        cu_seqlens = packed_seq_params.cu_seqlens_q.tolist()
        out = packed_causal_attention(query, key, value, cu_seqlens, self.softmax_scale, dropout_p)
        return out.reshape(out.shape[0], -1)


def _checked_shard(facts: MicroBatchFacts, params: PackedSeqParams) -> Optional[LocalShard]:
    """A DCP micro-batch's shard, once its params name the group its facts do (the script builds the params)."""
    cp_size, group = int(params.local_cp_size or 1), params.cp_group
    if cp_size != facts.cp_size or (facts.cp_size > 1 and group is None):
        raise ValueError(f"PackedSeqParams: local_cp_size={params.local_cp_size}, cp_group={group} but the DCP "
                         f"micro-batch runs on a CP group of {facts.cp_size}")
    if facts.cp_size > 1 and (group.size(), group.rank()) != (facts.cp_size, facts.cp_rank):
        raise ValueError(f"PackedSeqParams: cp_group is rank {group.rank()} of {group.size()}, the DCP micro-batch's "
                         f"facts say rank {facts.cp_rank} of {facts.cp_size}")
    return facts.attention_shard


def shard_from_params(params: PackedSeqParams) -> Optional[LocalShard]:
    """This rank's zig-zag shard, rebuilt from a CP micro-batch's params; None without a CP group."""
    cp_size = int(params.local_cp_size or 1)
    group = params.cp_group
    if cp_size <= 1 or group is None:
        return None
    if group.size() != cp_size:
        raise ValueError(f"PackedSeqParams: local_cp_size={cp_size} but cp_group has {group.size()} ranks")
    bounds = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    lengths = (bounds[1:] - bounds[:-1]).tolist()
    if any(length % (2 * cp_size) for length in lengths):
        raise ValueError(f"CP size {cp_size}: every padded document length must be a multiple of {2 * cp_size}, "
                         f"got {lengths}")
    return shard_microbatch([length for length in lengths if length > 0], cp_size, group.rank())


def sequence_cp_attention(query, key, value, group, softmax_scale: float) -> torch.Tensor:
    """Causal attention over zig-zag sharded sequences: q [S_local, B, H, D] -> [S_local, B, H * D]."""
    cp_size = group.size()
    shard = shard_microbatch([query.shape[0] * cp_size], cp_size, group.rank())
    outputs = [cp_attention(query[:, b], key[:, b], value[:, b], shard, group, softmax_scale=softmax_scale)
               for b in range(query.shape[1])]
    return torch.stack(outputs, dim=1).reshape(query.shape[0], query.shape[1], -1)


def sequence_causal_attention(query, key, value, softmax_scale: float, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention over whole sequences: q [S, B, H, D], k/v [S, B, Hkv, D] -> [S, B, H * D]."""
    num_heads, num_kv_heads = query.shape[2], key.shape[2]
    repeat = num_heads // num_kv_heads
    q = query.permute(1, 2, 0, 3)
    k = key.repeat_interleave(repeat, dim=2).permute(1, 2, 0, 3)
    v = value.repeat_interleave(repeat, dim=2).permute(1, 2, 0, 3)
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=softmax_scale)
    seq, batch = query.shape[0], query.shape[1]
    return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)


def packed_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: list[int],
    softmax_scale: float,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Causal attention inside each [cu_seqlens[i], cu_seqlens[i+1]) segment; q [T,H,D], k/v [T,Hkv,D]."""
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} key/value heads")
    if cu_seqlens[0] != 0 or cu_seqlens[-1] != query.shape[0]:
        raise ValueError(f"cu_seqlens {cu_seqlens[:3]}...{cu_seqlens[-1:]} do not cover {query.shape[0]} tokens")
    repeat = num_heads // num_kv_heads
    outputs = []
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        if end == start:
            continue
        # [L, H, D] -> [1, H, L, D] for SDPA (with a batch dimension: 3-D inputs take torch's math path on CPU,
        # which keeps the L x L probabilities for backward); GQA by repeating each key/value head.
        q = query[start:end].transpose(0, 1).unsqueeze(0)
        k = key[start:end].repeat_interleave(repeat, dim=1).transpose(0, 1).unsqueeze(0)
        v = value[start:end].repeat_interleave(repeat, dim=1).transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=softmax_scale)
        outputs.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(outputs, dim=0)
