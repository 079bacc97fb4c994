"""From a global batch to this rank's micro-batches of packed (THD) tokens.

A micro-batch is a list of sources (document_id, token_offset, length). Its model input is
the documents' tokens concatenated: inputs doc[o:o+L], labels doc[o+1:o+L+1], positions
restarting at every document, document bounds in `cu_seqlens`. When the token count must be
a multiple of some size (sequence parallelism splits tokens over the TP group) a padding
segment is appended, masked out of the loss; it attends only to itself.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from megatron.core.packed_seq_params import PackedSeqParams

Source = tuple[int, int, int]  # (document_id, token_offset, length)


def static_dp_microbatches(sources: Sequence[Source], *, dp_size: int, dp_rank: int,
                           tokens_per_microbatch: int) -> list[list[Source]]:
    """Megatron's static layout: pack sequences in order into micro-batches of at most
    `tokens_per_microbatch` tokens and deal them to DP replicas round-robin. A replica left
    without work gets one empty micro-batch (padding only) so every rank joins the step."""
    packed: list[list[Source]] = []
    used = tokens_per_microbatch
    for source in sources:
        if used + source[2] > tokens_per_microbatch:
            packed.append([])
            used = 0
        packed[-1].append(source)
        used += source[2]
    mine = packed[dp_rank::dp_size]
    return mine or [[]]


def assemble_microbatch(sources: Sequence[Source], document_tokens: Callable[[int], torch.Tensor], *,
                        pad_to_multiple: int = 1) -> dict:
    """Tensors of one micro-batch for GPTModel (batch dimension 1, THD packing)."""
    inputs, labels, positions, mask, bounds = [], [], [], [], [0]
    for document_id, offset, length in sources:
        tokens = document_tokens(document_id)
        if offset + length + 1 > tokens.numel():
            raise ValueError(f"document {document_id} has {tokens.numel()} tokens; cannot train on positions "
                             f"{offset}..{offset + length} (needs a next token for each)")
        inputs.append(tokens[offset:offset + length])
        labels.append(tokens[offset + 1:offset + length + 1])
        positions.append(torch.arange(length))
        mask.append(torch.ones(length))
        bounds.append(bounds[-1] + length)
    padding = -bounds[-1] % pad_to_multiple or (pad_to_multiple if bounds[-1] == 0 else 0)
    if padding:
        inputs.append(torch.zeros(padding, dtype=torch.long))
        labels.append(torch.zeros(padding, dtype=torch.long))
        positions.append(torch.arange(padding))
        mask.append(torch.zeros(padding))
        bounds.append(bounds[-1] + padding)
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
    max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return {
        "tokens": torch.cat(inputs).unsqueeze(0),
        "labels": torch.cat(labels).unsqueeze(0),
        "position_ids": torch.cat(positions).unsqueeze(0),
        "loss_mask": torch.cat(mask).unsqueeze(0),
        "packed_seq_params": PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                                             max_seqlen_q=max_len, max_seqlen_kv=max_len),
    }
