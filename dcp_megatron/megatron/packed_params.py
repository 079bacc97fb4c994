"""Per-micro-batch attention metadata: Megatron's `PackedSeqParams` plus this rank's zig-zag shard.

Everything a DCP micro-batch's attention needs travels with the micro-batch, never in module
state: `cp_group` / `local_cp_size` (the upstream fields TE attention and our RoPE patch read),
the THD bounds in Megatron/TE's CP convention, and the `LocalShard` our CPU core attention uses.

THD convention under CP (TE and Megatron's THD RoPE): `cu_seqlens_q_padded` are the GLOBAL
bounds of the documents, each padded to a multiple of 2c; a rank holds padded_len / c rows of
each document. `cu_seqlens_q` are the global bounds of the true (unpadded) lengths.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams

from dcp_megatron.runtime.sharding import LocalShard


@dataclass
class ShardPackedSeqParams(PackedSeqParams):
    """PackedSeqParams of one DCP micro-batch; `shard` is what this rank holds of it.

    TE forwards only the fields of the base class, so the extra field never reaches it."""

    shard: Optional[LocalShard] = None


def _prefix_sums(lengths) -> torch.Tensor:
    bounds = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    if lengths:
        bounds[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0).to(torch.int32)
    return bounds


def shard_packed_seq_params(shard: LocalShard, group: "dist.ProcessGroup | None", *,
                            device: torch.device | str = "cpu") -> ShardPackedSeqParams:
    """Params for a micro-batch run by `group` (None: this rank alone) of which this rank holds `shard`."""
    padded = list(shard.padded_lengths)
    return ShardPackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=_prefix_sums(list(shard.doc_lengths)).to(device),
        cu_seqlens_kv=_prefix_sums(list(shard.doc_lengths)).to(device),
        cu_seqlens_q_padded=_prefix_sums(padded).to(device),
        cu_seqlens_kv_padded=_prefix_sums(padded).to(device),
        max_seqlen_q=max(padded),
        max_seqlen_kv=max(padded),
        local_cp_size=shard.cp_size,
        cp_group=group,
        shard=shard,
    )
