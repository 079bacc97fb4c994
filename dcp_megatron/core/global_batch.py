"""A step's global batch under DCP: documents out of Megatron's samples, and to the ranks that run them.

Megatron's data loader hands every data-parallel rank its own share of the global batch
(`--global-batch-size` samples of `--seq-length` tokens, `--micro-batch-size` per pull). Under
`--dcp` the loop's schedule pulls the rank's whole share at once and:

1. cuts each sample into its documents at `cu_seqlens` (`--dataloader-inter-document-masking`;
   without it a sample is one sequence), keeping the dataset's tokens, labels and loss mask;
2. all-gathers the document lengths over the DCP domain (a few integers per document), so every
   rank plans the same step from the same `(sequence_id, length)` list, ids in domain-rank order;
3. after planning, sends every document from the rank that read it to each member of every group
   whose micro-batch holds it, in one `all_to_all_single` over the domain. No rank ever holds the
   whole global batch, only its own share and the documents of its own micro-batches.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dcp_megatron.planner.plan import StepPlan

# Rows of the exchange buffer: token id, label id, loss mask (0/1, as an integer).
ROW_FIELDS = 3


@dataclass(frozen=True)
class Documents:
    """Documents as [num_tokens, 3] int64 rows (token, label, loss mask), cut by `lengths`."""

    rows: torch.Tensor
    lengths: tuple[int, ...]

    def split(self) -> list[torch.Tensor]:
        return list(torch.split(self.rows, list(self.lengths))) if self.lengths else []


def _document_bounds(cu_seqlens: torch.Tensor | None, seq_length: int) -> list[int]:
    """Megatron pads each sample's cu_seqlens with copies of seq_length; keep the prefix up to the first."""
    if cu_seqlens is None:
        return [0, seq_length]
    bounds = [int(b) for b in cu_seqlens.tolist()]
    end = bounds.index(seq_length) if seq_length in bounds else len(bounds) - 1
    bounds = bounds[:end + 1]
    if bounds[0] != 0 or bounds[-1] != seq_length or any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
        raise ValueError(f"sample cu_seqlens {bounds[:4]}...{bounds[-2:]} do not cover the sample's "
                         f"{seq_length} tokens in order")
    return bounds


def split_samples(samples: list[dict]) -> Documents:
    """This rank's documents, sample by sample, from Megatron's micro-batch dicts."""
    pieces, lengths = [], []
    for sample in samples:
        tokens = sample["tokens"]
        if tokens.dim() != 2:
            raise ValueError(f"expected tokens of shape [micro_batch, seq_length], got {tuple(tokens.shape)}")
        for row in range(tokens.shape[0]):
            cu = sample.get("cu_seqlens")
            bounds = _document_bounds(None if cu is None else cu[row], tokens.shape[1])
            rows = torch.stack([tokens[row].long(), sample["labels"][row].long(),
                                sample["loss_mask"][row].round().long()], dim=1).cpu()
            for start, end in zip(bounds[:-1], bounds[1:]):
                if end > start:
                    pieces.append(rows[start:end])
                    lengths.append(end - start)
    rows = torch.cat(pieces) if pieces else torch.zeros(0, ROW_FIELDS, dtype=torch.int64)
    return Documents(rows=rows, lengths=tuple(lengths))


def broadcast_documents(local: Documents | None, *, src: int, group) -> Documents | None:
    """`src`'s documents on every rank of `group` (TP peers and later stages read no data of their own).

    None on `src` (its data ran out) is None everywhere."""
    is_source = dist.get_rank() == src
    if is_source:
        count = torch.tensor([-1 if local is None else len(local.lengths)], dtype=torch.int64)
    else:
        count = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(count, src=src, group=group)
    if int(count) < 0:
        return None
    lengths = (torch.tensor(local.lengths, dtype=torch.int64) if is_source
               else torch.zeros(int(count), dtype=torch.int64))
    dist.broadcast(lengths, src=src, group=group)
    rows = local.rows if is_source else torch.empty(int(lengths.sum()), ROW_FIELDS, dtype=torch.int64)
    dist.broadcast(rows, src=src, group=group)
    return local if is_source else Documents(rows=rows, lengths=tuple(int(n) for n in lengths.tolist()))


def gather_lengths(lengths: tuple[int, ...], *, group, domain_size: int) -> list[tuple[int, ...]]:
    """Every domain rank's document lengths, in domain-rank order (collective over the domain)."""
    if domain_size == 1:
        return [tuple(lengths)]
    count = torch.tensor([len(lengths)], dtype=torch.int64)
    counts = [torch.zeros_like(count) for _ in range(domain_size)]
    dist.all_gather(counts, count, group=group)
    width = max(int(c) for c in counts)
    padded = torch.zeros(width, dtype=torch.int64)
    padded[:len(lengths)] = torch.tensor(lengths, dtype=torch.int64)
    rows = [torch.zeros_like(padded) for _ in range(domain_size)]
    dist.all_gather(rows, padded, group=group)
    return [tuple(int(x) for x in row[:int(n)]) for row, n in zip(rows, counts)]


@dataclass(frozen=True)
class DocumentIndex:
    """Global sequence ids of a step: id -> (owning domain rank, index there), and lengths."""

    owners: tuple[tuple[int, int], ...]
    lengths: tuple[int, ...]

    @staticmethod
    def build(per_rank_lengths: list[tuple[int, ...]]) -> "DocumentIndex":
        owners, lengths = [], []
        for rank, rank_lengths in enumerate(per_rank_lengths):
            owners.extend((rank, i) for i in range(len(rank_lengths)))
            lengths.extend(rank_lengths)
        return DocumentIndex(owners=tuple(owners), lengths=tuple(lengths))

    def sequences(self) -> list[tuple[int, int]]:
        return list(enumerate(self.lengths))


def documents_needed(plan: StepPlan, rank: int) -> list[int]:
    """Sequence ids this rank's micro-batches hold, in the order it runs them (no repeats)."""
    needed: list[int] = []
    for _, group in plan.rank_schedule(rank):
        for microbatch in group.microbatches:
            needed.extend(int(sid) for sid, _ in microbatch.sequences)
    return needed


def exchange_documents(plan: StepPlan, local: Documents, index: DocumentIndex, *, domain_rank: int,
                       group) -> dict[int, torch.Tensor]:
    """The rows of every document this rank's micro-batches need, by sequence id (collective)."""
    domain_size = plan.domain_size
    mine = local.split()
    needs = [documents_needed(plan, rank) for rank in range(domain_size)]
    if domain_size == 1:
        return {sid: mine[index.owners[sid][1]] for sid in needs[0]}
    send_parts, send_sizes, recv_sizes = [], [], []
    for dst in range(domain_size):
        owned = [sid for sid in needs[dst] if index.owners[sid][0] == domain_rank]
        send_parts.extend(mine[index.owners[sid][1]] for sid in owned)
        send_sizes.append(sum(index.lengths[sid] for sid in owned))
    received_order: list[int] = []
    for src in range(domain_size):
        from_src = [sid for sid in needs[domain_rank] if index.owners[sid][0] == src]
        received_order.extend(from_src)
        recv_sizes.append(sum(index.lengths[sid] for sid in from_src))
    send = torch.cat(send_parts) if send_parts else torch.zeros(0, ROW_FIELDS, dtype=torch.int64)
    recv = torch.empty(sum(recv_sizes), ROW_FIELDS, dtype=torch.int64)
    dist.all_to_all_single(recv, send, output_split_sizes=recv_sizes, input_split_sizes=send_sizes, group=group)
    pieces = torch.split(recv, [index.lengths[sid] for sid in received_order]) if received_order else []
    return dict(zip(received_order, pieces))
