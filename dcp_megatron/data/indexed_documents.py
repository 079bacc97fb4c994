"""Whole documents from megatron-core indexed datasets (.bin/.idx): reader and writer.

The files are megatron-core's own format (megatron.core.datasets.indexed_dataset), so data
prepared by Megatron's tools can be read here and ours by Megatron. A Megatron "document" is
a run of one or more "sequences" written back to back; here a document is that whole run,
its tokens contiguous in the .bin. Lengths come from the index alone.

megatron-core checks little and reports it with bare asserts or numpy buffer errors (or
not at all: a truncated .bin reads as garbage), so `IndexedDocuments` checks the header,
the exact .idx size, the index's internal consistency and the .bin size against the index
before use, and raises `IndexedDataError` naming the file and what is wrong.
"""
from __future__ import annotations

import os
import struct
from typing import Iterable

import numpy as np
from megatron.core.datasets.indexed_dataset import (
    DType,
    IndexedDataset,
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
)

from dcp_megatron.data.documents import MIN_DOCUMENT_TOKENS, TokenCountIndex

# megatron-core's .idx layout (indexed_dataset._IndexWriter): 9-byte magic, u64 version 1,
# u8 dtype code, u64 sequence count S, u64 document-index count D, then int32[S] lengths,
# int64[S] byte pointers, int64[D] document boundaries (sequence indices).
_INDEX_MAGIC = b"MMIDIDX\x00\x00"
_HEADER_BYTES = 9 + 8 + 1 + 8 + 8
_INTEGER_CODES = {DType.uint8.value, DType.int8.value, DType.int16.value, DType.int32.value,
                  DType.int64.value, DType.uint16.value}


class IndexedDataError(ValueError):
    """An indexed dataset that cannot be read as whole documents."""


def _check_index_header(idx_path: str) -> None:
    size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as stream:
        header = stream.read(_HEADER_BYTES)
    if len(header) < _HEADER_BYTES:
        raise IndexedDataError(f"{idx_path}: truncated index header ({size} bytes, need at least {_HEADER_BYTES})")
    if header[:9] != _INDEX_MAGIC:
        raise IndexedDataError(f"{idx_path}: not a megatron-core index file (magic {header[:9]!r}, "
                               f"expected {_INDEX_MAGIC!r})")
    version, dtype_code, num_sequences, num_boundaries = struct.unpack("<QBQQ", header[9:])
    if version != 1:
        raise IndexedDataError(f"{idx_path}: unsupported index version {version} (megatron-core writes 1)")
    if dtype_code not in _INTEGER_CODES:
        raise IndexedDataError(f"{idx_path}: token dtype code {dtype_code} is not an integer type "
                               f"(valid codes {sorted(_INTEGER_CODES)})")
    expected = _HEADER_BYTES + 4 * num_sequences + 8 * num_sequences + 8 * num_boundaries
    if size < expected:
        raise IndexedDataError(f"{idx_path}: truncated index: {size} bytes, but its header promises {num_sequences} "
                               f"sequences and {num_boundaries} document boundaries ({expected} bytes)")
    if size > expected:
        raise IndexedDataError(f"{idx_path}: {size - expected} unexpected bytes after the index of {num_sequences} "
                               f"sequences (multimodal indexes are not supported)")


class IndexedDocuments(TokenCountIndex):
    """`DocumentSource` over a megatron-core indexed dataset at `path_prefix` (.bin/.idx).

    vocab_size: when given, every read checks its token ids are in [0, vocab_size), so a
    corrupt .bin or a dataset made with another tokenizer fails here, naming the document,
    not deep inside the embedding.
    """

    def __init__(self, path_prefix: str, *, vocab_size: int | None = None) -> None:
        if path_prefix.endswith((".bin", ".idx")):
            raise IndexedDataError(f"{path_prefix!r}: give the path prefix without .bin/.idx "
                                   f"(e.g. {path_prefix[:-4]!r})")
        if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int)
                                       or vocab_size < 1):
            raise ValueError(f"vocab_size must be a positive int or None, got {vocab_size!r}")
        self.path_prefix = path_prefix
        self.vocab_size = vocab_size
        self.idx_path, self.bin_path = get_idx_path(path_prefix), get_bin_path(path_prefix)
        for path in (self.idx_path, self.bin_path):
            if not os.path.isfile(path):
                raise IndexedDataError(f"{path}: no such file (indexed dataset prefix {path_prefix!r} needs both "
                                       f".bin and .idx; make one with tools/preprocess_data.py)")
        _check_index_header(self.idx_path)
        if os.path.getsize(self.bin_path) == 0:
            raise IndexedDataError(f"{self.bin_path}: empty data file")
        try:
            self._dataset = IndexedDataset(path_prefix, multimodal=False, mmap=True)
        except (AssertionError, ValueError, OSError, struct.error) as err:
            raise IndexedDataError(f"megatron-core cannot open the indexed dataset {path_prefix!r}: "
                                   f"{type(err).__name__}: {err}") from err
        self._dtype = np.dtype(self._dataset.index.dtype)
        self._token_counts, self._first_sequence = self._document_table()

    def _document_table(self) -> tuple[np.ndarray, np.ndarray]:
        """Per document: token count, and its first sequence (whose pointer starts the document)."""
        index = self._dataset.index
        seq_lengths = np.asarray(index.sequence_lengths, dtype=np.int64)
        pointers = np.asarray(index.sequence_pointers, dtype=np.int64)
        boundaries = np.asarray(index.document_indices, dtype=np.int64)
        where = f"{self.idx_path}: corrupt index:"
        if boundaries.size < 2:
            raise IndexedDataError(f"{self.idx_path}: the index holds no documents")
        if boundaries[0] != 0 or boundaries[-1] != seq_lengths.size or np.any(np.diff(boundaries) < 0):
            raise IndexedDataError(f"{where} document boundaries must rise from 0 to {seq_lengths.size} sequences, "
                                   f"got {boundaries[0]}..{boundaries[-1]} (non-decreasing: "
                                   f"{bool(np.all(np.diff(boundaries) >= 0))})")
        if np.any(seq_lengths < 0):
            raise IndexedDataError(f"{where} negative sequence length at sequence {int(np.argmax(seq_lengths < 0))}")
        starts = np.concatenate(([0], np.cumsum(seq_lengths)[:-1])) * self._dtype.itemsize
        if not np.array_equal(pointers, starts):
            bad = int(np.argmax(pointers != starts))
            raise IndexedDataError(f"{where} sequence {bad} points at byte {int(pointers[bad])}, expected "
                                   f"{int(starts[bad])} (sequences must be back to back)")
        total_tokens = int(seq_lengths.sum())
        bin_bytes = os.path.getsize(self.bin_path)
        if bin_bytes != total_tokens * self._dtype.itemsize:
            raise IndexedDataError(
                f"{self.bin_path}: {bin_bytes} bytes, but {self.idx_path} describes {total_tokens} tokens of "
                f"{self._dtype.name} ({total_tokens * self._dtype.itemsize} bytes): the .bin is truncated or the "
                f"two files do not belong together")
        cumulative = np.concatenate(([0], np.cumsum(seq_lengths)))
        token_counts = cumulative[boundaries[1:]] - cumulative[boundaries[:-1]]
        too_short = np.flatnonzero(token_counts < MIN_DOCUMENT_TOKENS)
        if too_short.size:
            first = int(too_short[0])
            raise IndexedDataError(
                f"{self.path_prefix}: {too_short.size} document(s) have fewer than {MIN_DOCUMENT_TOKENS} tokens "
                f"(e.g. document {first}: {int(token_counts[first])}) and cannot train; rebuild it with "
                f"tools/preprocess_data.py, which drops them")
        return token_counts, boundaries[:-1].copy()

    # ---- DocumentSource ----------------------------------------------------------------------
    @property
    def num_documents(self) -> int:
        return int(self._token_counts.size)

    def tokens(self, doc_id: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        doc_id, start, stop = self._checked_range(doc_id, start, stop)
        # Documents are contiguous (checked at open), so one read from the first sequence covers it.
        window = self._dataset.get(int(self._first_sequence[doc_id]), offset=start, length=stop - start)
        window = np.array(window, dtype=np.int64)
        if self.vocab_size is not None and window.size and (window.min() < 0 or window.max() >= self.vocab_size):
            bad = int(window[(window < 0) | (window >= self.vocab_size)][0])
            raise IndexedDataError(f"{self.bin_path}: document {doc_id} holds token id {bad}, outside the vocabulary "
                                   f"[0, {self.vocab_size}): corrupt data or another tokenizer's dataset")
        return window


def write_indexed_documents(path_prefix: str, documents: Iterable[np.ndarray], *, vocab_size: int) -> dict:
    """Write documents (token id arrays) as a megatron-core indexed dataset, one sequence each.

    Documents with fewer than MIN_DOCUMENT_TOKENS tokens cannot train and are dropped.
    Both files are written under temporary names and renamed at the end, so a failure never
    leaves a half-written dataset that looks complete.
    Returns {"documents", "tokens", "dropped"}: counts of what was written and dropped.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    dtype = DType.optimal_dtype(vocab_size)
    bin_path, idx_path = get_bin_path(path_prefix), get_idx_path(path_prefix)
    directory = os.path.dirname(os.path.abspath(bin_path))
    if not os.path.isdir(directory):
        raise ValueError(f"output directory {directory} does not exist")
    tmp_bin, tmp_idx = bin_path + ".partial", idx_path + ".partial"
    builder = IndexedDatasetBuilder(tmp_bin, dtype=dtype)
    stats = {"documents": 0, "tokens": 0, "dropped": 0}
    try:
        for index, doc in enumerate(documents):
            doc = np.asarray(doc)
            if doc.size and (doc.min() < 0 or doc.max() >= vocab_size):
                raise ValueError(f"document {index} holds token ids outside [0, {vocab_size})")
            if doc.size < MIN_DOCUMENT_TOKENS:
                stats["dropped"] += 1
                continue
            builder.add_document(doc.astype(dtype, copy=False), [int(doc.size)])
            stats["documents"] += 1
            stats["tokens"] += int(doc.size)
        if stats["documents"] == 0:
            raise ValueError(f"no document with at least {MIN_DOCUMENT_TOKENS} tokens to write "
                             f"({stats['dropped']} dropped)")
        builder.finalize(tmp_idx)
        os.replace(tmp_bin, bin_path)
        os.replace(tmp_idx, idx_path)
    finally:
        builder.data_file.close()
        for path in (tmp_bin, tmp_idx):
            if os.path.exists(path):
                os.remove(path)
    return stats
