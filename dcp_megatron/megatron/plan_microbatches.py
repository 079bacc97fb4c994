"""This rank's micro-batches of a StepPlan, as the tensors Megatron's schedules feed GPTModel.

For each group the rank belongs to (wave after wave, as `StepPlan.rank_schedule` orders them),
each micro-batch's documents are read from the corpus (only the ones this rank's groups need),
zig-zag sharded over the group (`shard_microbatch`) and turned into a THD micro-batch: tokens,
labels, per-document positions, a loss mask that is False at padding, and
`ShardPackedSeqParams` carrying the group and the shard to the attention.

Filler documents: a micro-batch without sequences (a PP filler, or a rank the plan leaves idle)
holds one masked 1-token document, so every rank still runs forward and backward and joins its
group's collectives; with sequence parallelism masked 1-token documents are appended until
the local row count divides the TP size.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from dcp_megatron.data.assembly import assemble_microbatch
from dcp_megatron.planner.plan import NO_RECOMPUTE, MicroBatch, Recompute, StepPlan
from dcp_megatron.runtime.sharding import shard_microbatch
from dcp_megatron.megatron.packed_params import ShardPackedSeqParams, shard_packed_seq_params


@dataclass(frozen=True)
class RankMicroBatch:
    wave_index: int
    group_size: int
    recompute: Recompute
    tokens: torch.Tensor          # [1, T_local]
    labels: torch.Tensor          # [1, T_local]
    position_ids: torch.Tensor    # [1, T_local]
    loss_mask: torch.Tensor       # [1, T_local] float, 0 at padding and filler documents
    packed_seq_params: ShardPackedSeqParams


def build_microbatch(microbatch: MicroBatch, *, source, batch, group, group_size: int, group_rank: int,
                     wave_index: int, rows_multiple: int = 1, device="cpu") -> RankMicroBatch:
    lengths = list(microbatch.lengths)
    if lengths:
        assembled = assemble_microbatch(source, batch, microbatch)
        tokens, labels = assembled.tokens, assembled.labels
    else:
        tokens = labels = torch.zeros(0, dtype=torch.int64)
    num_real_tokens = int(tokens.numel())
    if not lengths:
        lengths = [1]
    shard = shard_microbatch(lengths, group_size, group_rank)
    while shard.num_local_tokens % rows_multiple:
        lengths.append(1)
        shard = shard_microbatch(lengths, group_size, group_rank)
    filler = sum(lengths) - num_real_tokens
    if filler:
        zeros = torch.zeros(filler, dtype=torch.int64)
        tokens, labels = torch.cat([tokens, zeros]), torch.cat([labels, zeros])
    real = shard.valid_mask & (shard.token_index < num_real_tokens)

    def row(x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(0).to(device)

    return RankMicroBatch(
        wave_index=wave_index, group_size=group_size,
        recompute=microbatch.recompute if microbatch.sequences else NO_RECOMPUTE,
        tokens=row(shard.take(tokens)), labels=row(shard.take(labels)), position_ids=row(shard.position_ids),
        loss_mask=row(real.to(torch.float32)),
        packed_seq_params=shard_packed_seq_params(shard, group, device=device))


def rank_microbatches(plan: StepPlan, *, pool, source, batch, rows_multiple: int = 1,
                      device="cpu") -> Iterator[RankMicroBatch]:
    """This rank's micro-batches in plan order; one filler micro-batch if the plan gives it none."""
    rank = pool.domain_rank
    count = 0
    for wave_index, group in plan.rank_schedule(rank):
        process_group = pool.group(group.first_rank, group.size)
        for microbatch in group.microbatches:
            count += 1
            yield build_microbatch(microbatch, source=source, batch=batch, group=process_group,
                                   group_size=group.size, group_rank=rank - group.first_rank,
                                   wave_index=wave_index, rows_multiple=rows_multiple, device=device)
    if count == 0:
        yield build_microbatch(MicroBatch(()), source=source, batch=batch, group=None, group_size=1,
                               group_rank=0, wave_index=0, rows_multiple=rows_multiple, device=device)


def num_rank_microbatches(plan: StepPlan, rank: int) -> int:
    return max(plan.num_microbatches(rank), 1)
