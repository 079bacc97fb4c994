"""Micro-batch assembly for tests: the tokens and labels of one plan micro-batch, read from a `DocumentSource`.

Only the documents the micro-batch needs are read. Sequences are concatenated in micro-batch order (the packed
THD layout the runtime shards); a piece (document_id, o, L) contributes inputs doc[o:o+L] and labels
doc[o+1:o+L+1] (dcp_megatron/data/documents.py), so no label ever crosses into another document.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
import torch

from dcp_megatron.data.documents import DocumentSource
from dcp_megatron.planner.batcher import GlobalBatch
from dcp_megatron.planner.plan import MicroBatch


class AssembledMicroBatch(NamedTuple):
    tokens: torch.Tensor   # int64 [sum of lengths]: model inputs
    labels: torch.Tensor   # int64 [sum of lengths]: next token of each input, same document


def microbatch_arrays(source: DocumentSource, batch: GlobalBatch,
                      sequences: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """numpy form of `assemble_microbatch`: (inputs, labels), int64 [sum L]."""
    pieces = dict(zip((seq_id for seq_id, _ in batch.sequences), batch.sources))
    inputs, labels = [], []
    for seq_id, length in sequences:
        piece = pieces.get(seq_id)
        if piece is None:
            raise ValueError(f"sequence {seq_id} of the micro-batch is not in global batch step {batch.step}")
        doc_id, offset, piece_length = piece
        if piece_length != length:
            raise ValueError(f"sequence {seq_id} has length {length} in the micro-batch but {piece_length} in "
                             f"global batch step {batch.step} (document {doc_id}, offset {offset})")
        window = np.asarray(source.tokens(doc_id, offset, offset + length + 1), dtype=np.int64)
        assert window.size == length + 1, (doc_id, offset, length, window.size)
        inputs.append(window[:-1])
        labels.append(window[1:])
    if not inputs:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty.copy()
    return np.concatenate(inputs), np.concatenate(labels)


def assemble_microbatch(source: DocumentSource, batch: GlobalBatch,
                        microbatch: MicroBatch | Sequence[tuple[int, int]]) -> AssembledMicroBatch:
    """Tokens and labels of `microbatch` (a plan MicroBatch, or its sequences [(seq_id, L)])."""
    sequences = microbatch.sequences if isinstance(microbatch, MicroBatch) else microbatch
    inputs, labels = microbatch_arrays(source, batch, sequences)
    return AssembledMicroBatch(tokens=torch.from_numpy(inputs), labels=torch.from_numpy(labels))
