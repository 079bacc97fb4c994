"""This rank's micro-batches of a StepPlan, as the batch dicts a Megatron-LM `get_batch` reads.

Each micro-batch's documents are zig-zag sharded over its CP group (`shard_microbatch`) and
packed THD into the 0.19 packed-sequence contract of Megatron-LM's `pretrain_gpt.py`:

- `tokens`, `labels`, `loss_mask`, `position_ids`: [1, T_local], this rank's rows; the loss mask
  is the dataset's, and 0 at the padding each document gets to a multiple of 2c; padding rows carry
  their document's last position (never an index past a learned position table);
- `cu_seqlens`: [1, n+1] global bounds of the true document lengths (FLOP accounting);
  `cu_seqlens_padded`: [1, n+1] global bounds of the padded documents (what attention and RoPE
  use, TE's THD-under-CP convention); `max_seqlen`: [1]; `local_cp_size`: [1], the group size c;
- `dcp_microbatch` (`MICROBATCH_KEY`): the micro-batch's `MicroBatchFacts` (microbatch_facts.py: its CP group,
  recompute, attention flavour, router documents, indices), the one carrier the patches read. It is not a
  tensor, so `get_batch`'s `.cuda()` loop (over its known keys) passes it by; our patched
  `get_batch_on_this_cp_rank` turns its group into the batch's `hybrid_cp_group`, which the script hands
  to `PackedSeqParams.cp_group` — the upstream seam for a per-micro-batch CP group.

A rank the plan gives no micro-batch runs one filler: a masked 1-token document (with the recompute the plan
names for it: under ZeRO-3 its wave's, so its weight gathers pair with its peers'), so it still
joins the step's gradient reduction. With `row_multiple` > 1 (FP8: TE's FP8 GEMMs need the token rows
per TP shard divisible by 16, fp8_checks.py) a masked filler document is appended to a micro-batch whose
local rows fall short of a multiple; it attends only to itself and carries no loss, so no loss or
gradient changes. With `equal_rows` (MoE token exchanges that gather over the expert-parallel group: the
allgather and flex dispatchers at EP > 1) the same filler brings every rank's micro-batch of a lockstep wave to
the wave's most local rows, so the EP peers' gathers see equal shapes; MoE routers leave filler rows out of
their balancing and z losses (moe_aux.py).
"""
from __future__ import annotations

import math
import torch

from dcp_megatron.core.global_batch import ROW_FIELDS
from dcp_megatron.core.microbatch_facts import MICROBATCH_KEY, MicroBatchFacts
from dcp_megatron.core.moe_aux import RouterDocuments, microbatch_documents
from dcp_megatron.planner.plan import NO_RECOMPUTE, Recompute, StepPlan
from dcp_megatron.planner.padding import padded_length
from dcp_megatron.runtime.sharding import shard_microbatch

def _prefix(lengths) -> torch.Tensor:
    bounds = torch.zeros(1, len(lengths) + 1, dtype=torch.int32)
    bounds[0, 1:] = torch.cumsum(torch.tensor(list(lengths), dtype=torch.int64), 0).to(torch.int32)
    return bounds


def build_batch(documents: list[torch.Tensor], *, cp_size: int, cp_rank: int, group, recompute: Recompute,
                wave_index: int, device, pad_multiple: int = 1, attention: str = "allgather",
                row_multiple: int = 1, step_num_tokens: int = 0, local_rows: int | None = None,
                longest_filler: int | None = None, microbatch_index: int = 0) -> dict:
    """One micro-batch dict from its documents' [L, 3] rows (token, label, loss mask).

    `pad_multiple`: every document's local rows become a multiple of it (the TP size under sequence
    parallelism, which splits the rows evenly over the TP group). `row_multiple`: the micro-batch's
    local rows become a multiple of it, by a masked filler document at the end. `local_rows`: exactly that
    many local rows, by the same filler (at least the aligned count; `wave_local_rows`), cut into documents
    of at most `longest_filler` tokens (inside a learned position table, and attention no dearer than the
    real documents'). `microbatch_index`: its place among the rank's micro-batches of the step."""
    if documents:
        rows = torch.cat(documents)
        lengths = [int(d.shape[0]) for d in documents]
    else:  # filler: one masked token
        rows = torch.zeros(1, ROW_FIELDS, dtype=torch.int64)
        lengths = [1]
    shard = shard_microbatch(lengths, cp_size, cp_rank, pad_multiple=pad_multiple)
    filler_rows = aligned_filler_rows(shard.num_local_tokens, row_multiple=row_multiple, pad_multiple=pad_multiple)
    if local_rows is not None:
        filler_rows = local_rows - shard.num_local_tokens
        if filler_rows < 0 or filler_rows % (2 * pad_multiple):
            raise ValueError(f"cannot pad {shard.num_local_tokens} local rows to {local_rows} with a filler "
                             f"document (its local rows must be a multiple of {2 * pad_multiple}, >= 0)")
    if filler_rows:
        # every rank of the group adds the same filler (c x its local rows): cu_seqlens stay identical
        rows = torch.cat([rows, torch.zeros(cp_size * filler_rows, ROW_FIELDS, dtype=rows.dtype)])
        lengths = [*lengths, *_filler_documents(cp_size * filler_rows, unit=2 * cp_size * pad_multiple,
                                                longest=longest_filler)]
        shard = shard_microbatch(lengths, cp_size, cp_rank, pad_multiple=pad_multiple)
    local = shard.take(rows)
    loss_mask = local[:, 2].to(torch.float32) * shard.valid_mask.to(torch.float32)

    def row(x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(0).to(device)

    # Rows of real documents: not padding, not a filler document (an idle rank's, or the row alignment's).
    document_ids = microbatch_documents(shard.doc_ids, shard.valid_mask, len(documents))
    router_documents = RouterDocuments(
        document_ids=document_ids.to(device), document_lengths=tuple(lengths[:len(documents)]),
        groups=(group,) if cp_size > 1 else (), step_num_tokens=max(step_num_tokens, sum(lengths[:len(documents)])))
    facts = MicroBatchFacts(wave_index=wave_index, cp_size=cp_size, cp_rank=cp_rank,
                            group=group if cp_size > 1 else None,
                            recompute=recompute,   # a filler's too: under ZeRO-3 it replays as its wave does
                            attention=attention if cp_size > 1 else "allgather",
                            router_documents=router_documents, padded_lengths=tuple(shard.padded_lengths),
                            microbatch_index=microbatch_index)
    return {
        "tokens": row(local[:, 0]), "labels": row(local[:, 1]), "loss_mask": row(loss_mask),
        "position_ids": row(shard.model_position_ids),   # inside a learned position table
        "cu_seqlens": _prefix(lengths).to(device),
        "cu_seqlens_padded": _prefix(shard.padded_lengths).to(device),
        "max_seqlen": torch.tensor([max(shard.padded_lengths)], dtype=torch.int32, device=device),
        "local_cp_size": torch.tensor([cp_size], dtype=torch.int32, device=device),
        MICROBATCH_KEY: facts,
    }


def _filler_documents(total: int, *, unit: int, longest: int | None) -> list[int]:
    """`total` filler tokens as documents of at most `longest` (each a multiple of `unit`, the zig-zag unit)."""
    if longest is None or total <= longest:
        return [total]
    piece = max(unit, longest // unit * unit)
    return [piece] * (total // piece) + ([total % piece] if total % piece else [])


def aligned_filler_rows(local_rows: int, *, row_multiple: int, pad_multiple: int = 1) -> int:
    """Local rows of the filler document that make `local_rows` a multiple of `row_multiple` (0: none).

    The filler is itself a document: its local rows are a multiple of 2 x pad_multiple (zig-zag halves,
    sequence-parallel shards), so the multiple actually reached is lcm(row_multiple, 2 x pad_multiple)."""
    if row_multiple < 1:
        raise ValueError(f"row_multiple must be >= 1, got {row_multiple}")
    if row_multiple == 1:
        return 0
    unit = math.lcm(row_multiple, 2 * pad_multiple)
    return -local_rows % unit


def wave_local_rows(plan: StepPlan, *, pad_multiple: int = 1, row_multiple: int = 1) -> list[int]:
    """Per wave, the most local rows any rank's micro-batch holds (documents padded and rows aligned as
    `build_batch` does; an idle micro-batch is a 1-token filler)."""
    most = []
    for wave in plan.waves:
        rows = [0]
        for group in wave.groups:
            for microbatch in group.microbatches:
                lengths = [length for _, length in microbatch.sequences] or [1]
                local = sum(padded_length(n, group.size, pad_multiple) for n in lengths) // group.size
                rows.append(local + aligned_filler_rows(local, row_multiple=row_multiple, pad_multiple=pad_multiple))
        most.append(max(rows))
    return most


def rank_batches(plan: StepPlan, documents: dict[int, torch.Tensor], *, pool, device,
                 pad_multiple: int = 1, row_multiple: int = 1, equal_rows: bool = False) -> list[dict]:
    """This rank's micro-batch dicts in plan order (wave after wave); one filler if it has none.

    `equal_rows` (a lockstep plan: one micro-batch per group per wave): every rank's micro-batch of a wave
    gets the wave's most local rows (module docstring)."""
    rank = pool.domain_rank
    step_num_tokens = sum(length for _, length in plan.sequences())
    if equal_rows and any(len(group.microbatches) != 1 for wave in plan.waves for group in wave.groups):
        raise ValueError("equal rows per wave need a lockstep plan (one micro-batch per group per wave)")
    targets = wave_local_rows(plan, pad_multiple=pad_multiple, row_multiple=row_multiple) if equal_rows else None
    longest = max((length for _, length in plan.sequences()), default=1) if equal_rows else None
    batches = []
    for wave_index, group in plan.rank_schedule(rank):
        process_group = pool.group(group.first_rank, group.size)
        for microbatch in group.microbatches:
            docs = [documents[int(sid)] for sid, _ in microbatch.sequences]
            batches.append(build_batch(docs, cp_size=group.size, cp_rank=rank - group.first_rank,
                                       group=process_group, recompute=microbatch.recompute,
                                       wave_index=wave_index, device=device, pad_multiple=pad_multiple,
                                       attention=microbatch.attention, row_multiple=row_multiple,
                                       step_num_tokens=step_num_tokens,
                                       local_rows=None if targets is None else targets[wave_index],
                                       longest_filler=longest, microbatch_index=len(batches)))
    if not batches:
        batches.append(build_batch([], cp_size=1, cp_rank=0, group=None, recompute=NO_RECOMPUTE,
                                   wave_index=0, device=device, pad_multiple=pad_multiple,
                                   row_multiple=row_multiple))
    return batches


def with_fillers_to_multiple(batches: list[dict], multiple: int, *, device, pad_multiple: int = 1) -> list[dict]:
    """`batches` and masked fillers up to a multiple of `multiple` micro-batches: Megatron's interleaved (virtual
    stage) schedule runs micro-batches in groups of `microbatch_group_size_per_vp_stage` (the PP size by
    default). Every rank runs the same count under PP (one micro-batch per group per wave), so all pad alike."""
    missing = -len(batches) % multiple
    wave_index = batches[-1][MICROBATCH_KEY].wave_index + 1 if batches else 0
    return batches + [build_batch([], cp_size=1, cp_rank=0, group=None, recompute=NO_RECOMPUTE,
                                  wave_index=wave_index + i, device=device, pad_multiple=pad_multiple,
                                  microbatch_index=len(batches) + i)
                      for i in range(missing)]
