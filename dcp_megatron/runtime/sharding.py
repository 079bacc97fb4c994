"""Zig-zag sharding of one packed micro-batch over a context-parallel group.

Every document of the micro-batch is padded to a multiple of 2c tokens (c = CP size) and cut
into 2c equal chunks; group rank i holds chunks i and 2c-1-i, in that order. Pairing an early
chunk with a late one gives every rank the same share of causal-attention work (the layout
Megatron and Transformer Engine use). The rank's pieces are packed document after document
(THD), so each document occupies `padded_len // c` consecutive local rows on every rank and
`cu_seqlens` is identical on all ranks of the group.

Tokens keep their position inside their own document (RoPE and the causal mask use it).
Padding rows sit at positions >= the document's true length: they carry `token_index == -1`,
`valid_mask == False`, and must be left out of the loss.

This is pure index math on CPU tensors; nothing here communicates.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from dcp_megatron.planner.padding import padded_length


@dataclass(frozen=True)
class LocalShard:
    """What one rank of a CP group holds of a micro-batch (all tensors on CPU, one row per local token)."""

    cp_size: int
    cp_rank: int
    doc_lengths: tuple[int, ...]     # true token counts of the micro-batch's documents, in order
    padded_lengths: tuple[int, ...]  # each rounded up to a multiple of 2 * cp_size * pad_multiple
    token_index: torch.Tensor        # int64 [T_local]: index into the concatenated true tokens, -1 at padding
    position_ids: torch.Tensor       # int64 [T_local]: position inside the token's own document
    doc_ids: torch.Tensor            # int64 [T_local]: index of the token's document in the micro-batch
    valid_mask: torch.Tensor         # bool  [T_local]: False at padding
    cu_seqlens: torch.Tensor         # int32 [num_docs + 1]: prefix sums of local rows per document
    pad_multiple: int = 1            # local rows per document are a multiple of 2 * pad_multiple

    @property
    def num_local_tokens(self) -> int:
        """Local rows, padding included (the same on every rank of the group)."""
        return int(self.token_index.numel())

    @property
    def num_valid_tokens(self) -> int:
        return int(self.valid_mask.sum())

    @property
    def num_docs(self) -> int:
        return len(self.doc_lengths)

    @property
    def model_position_ids(self) -> torch.Tensor:
        """Positions for the model's input rows: `position_ids` with each padding row at its document's last
        true position. Padding a document to a multiple of 2c can run past the longest allowed document
        (1024 -> 1026 at c = 3), and a learned position table (Megatron's default) has only
        --max-position-embeddings rows. Padding rows are out of the loss and come last in causal order, so no
        real token sees them: their position is free, and this one is always inside the table."""
        last = torch.tensor(self.doc_lengths, dtype=torch.int64)[self.doc_ids] - 1
        return torch.minimum(self.position_ids, last)

    def take(self, x: torch.Tensor, fill: float = 0) -> torch.Tensor:
        """This rank's rows of x [sum(doc_lengths), ...] -> [T_local, ...]; padding rows = fill.

        Differentiable: the gradient flows back into x's selected rows.
        """
        total = sum(self.doc_lengths)
        if x.shape[0] != total:
            raise ValueError(f"take() expects {total} rows (sum of doc_lengths), got shape {tuple(x.shape)}")
        index = self.token_index.to(x.device)
        rows = x.index_select(0, index.clamp(min=0))
        if self.num_valid_tokens == self.num_local_tokens:
            return rows
        mask = self.valid_mask.to(x.device).view(-1, *([1] * (x.dim() - 1)))
        return torch.where(mask, rows, torch.full_like(rows, fill))

    def for_rank(self, cp_rank: int) -> "LocalShard":
        """The shard another rank of the same group holds (computed locally, nothing is sent)."""
        return shard_microbatch(self.doc_lengths, self.cp_size, cp_rank, pad_multiple=self.pad_multiple)


def shard_microbatch(doc_lengths: Sequence[int], cp_size: int, cp_rank: int, *, pad_multiple: int = 1) -> LocalShard:
    """The zig-zag shard of a micro-batch with documents `doc_lengths` held by `cp_rank` of a group of `cp_size`.

    `pad_multiple` > 1 pads every document further, so each rank's local row count is a multiple of
    it (sequence parallelism splits a micro-batch's rows evenly over the TP group)."""
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if pad_multiple < 1:
        raise ValueError(f"pad_multiple must be >= 1, got {pad_multiple}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")
    lengths = tuple(int(n) for n in doc_lengths)
    bad = [(i, n) for i, n in enumerate(lengths) if n < 1]
    if bad:
        raise ValueError(f"document lengths must be >= 1, got (index, length) {bad[:5]}")
    padded = tuple(padded_length(n, cp_size, pad_multiple) for n in lengths)

    true_len = torch.tensor(lengths, dtype=torch.int64)
    chunk_len = torch.tensor(padded, dtype=torch.int64) // (2 * cp_size)
    local_len = 2 * chunk_len
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    torch.cumsum(local_len, 0, out=cu_seqlens[1:])
    true_offset = torch.cumsum(true_len, 0) - true_len  # where each document starts in the true tokens

    num_local = int(cu_seqlens[-1])
    doc_ids = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int64), local_len)
    row_in_doc = torch.arange(num_local, dtype=torch.int64) - cu_seqlens[:-1][doc_ids]
    chunk = chunk_len[doc_ids]
    in_second_chunk = row_in_doc >= chunk
    # First local chunk is chunk `cp_rank`, the second is chunk `2c - 1 - cp_rank` of the document.
    chunk_index = torch.where(in_second_chunk, 2 * cp_size - 1 - cp_rank, cp_rank)
    position_ids = chunk_index * chunk + row_in_doc - in_second_chunk.to(torch.int64) * chunk
    valid_mask = position_ids < true_len[doc_ids]
    token_index = torch.where(valid_mask, true_offset[doc_ids] + position_ids, torch.full_like(position_ids, -1))
    return LocalShard(
        cp_size=cp_size,
        cp_rank=cp_rank,
        doc_lengths=lengths,
        padded_lengths=padded,
        token_index=token_index,
        position_ids=position_ids,
        doc_ids=doc_ids,
        valid_mask=valid_mask,
        cu_seqlens=cu_seqlens.to(torch.int32),
        pad_multiple=pad_multiple,
    )
