"""Cut an ordered stream of documents into global batches by a token budget.

Training sees documents in the order the data pipeline gives them; the batcher never
reorders across steps (that would change what the model learns and when). It only decides
where one step ends and the next begins: a batch takes whole sequences, in order, while
their total stays within `tokens_per_step`; the sequence that would overflow it starts the
next batch. The last, partial batch is emitted too.

A document longer than `max_seq_len` (the run's length cap) is an error by default, because
silently cutting it changes the training data. Two explicit opt-ins exist:
  overlong="split"     cut it into consecutive pieces of `max_seq_len` tokens (the last piece
                       holds the rest); each piece becomes its own sequence.
  overlong="truncate"  keep its first `max_seq_len` tokens, drop the rest.

Every emitted sequence gets a fresh `seq_id` (a running counter of pieces, so it equals the
position in the stream when nothing is split) and a source record
(document_id, token_offset, length) saying exactly which tokens of which document it holds.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Iterable, Iterator

OVERLONG_MODES = ("error", "split", "truncate")


def _positive_int(document_id: int, length: object) -> int:
    # operator.index accepts numpy integers but rejects floats and strings.
    try:
        value = operator.index(length)
    except TypeError:
        value = None
    if value is None or isinstance(length, bool) or value <= 0:
        raise ValueError(f"document {document_id} has length {length!r}; lengths must be positive integers")
    return value


@dataclass(frozen=True)
class GlobalBatch:
    """One training step's sequences, in stream order.

    sequences[i] = (seq_id, length): what the planner plans (its sample ids).
    sources[i]   = (document_id, token_offset, length): where those tokens come from.
    """

    step: int
    sequences: tuple[tuple[int, int], ...]
    sources: tuple[tuple[int, int, int], ...]

    @property
    def num_tokens(self) -> int:
        return sum(length for _, length in self.sequences)

    @property
    def max_length(self) -> int:
        return max((length for _, length in self.sequences), default=0)


@dataclass(frozen=True, kw_only=True)
class GlobalBatcher:
    tokens_per_step: int
    max_seq_len: int
    overlong: str = "error"

    def __post_init__(self) -> None:
        if not isinstance(self.tokens_per_step, int) or self.tokens_per_step <= 0:
            raise ValueError(f"GlobalBatcher.tokens_per_step must be a positive int, got {self.tokens_per_step!r}")
        if not isinstance(self.max_seq_len, int) or self.max_seq_len <= 0:
            raise ValueError(f"GlobalBatcher.max_seq_len must be a positive int, got {self.max_seq_len!r}")
        if self.max_seq_len > self.tokens_per_step:
            raise ValueError(f"GlobalBatcher.max_seq_len={self.max_seq_len} exceeds tokens_per_step="
                             f"{self.tokens_per_step}: such a sequence could never fit in a batch")
        if self.overlong not in OVERLONG_MODES:
            raise ValueError(f"GlobalBatcher.overlong must be one of {OVERLONG_MODES}, got {self.overlong!r}")

    def pieces(self, documents: Iterable[tuple[int, int]]) -> Iterator[tuple[int, int, int]]:
        """(document_id, token_offset, length) of every sequence, in order, overlong handled."""
        for document_id, length in documents:
            length = _positive_int(document_id, length)
            if length <= self.max_seq_len:
                yield document_id, 0, length
            elif self.overlong == "split":
                for offset in range(0, length, self.max_seq_len):
                    yield document_id, offset, min(self.max_seq_len, length - offset)
            elif self.overlong == "truncate":
                yield document_id, 0, self.max_seq_len
            else:
                raise ValueError(
                    f"document {document_id} has {length} tokens, more than max_seq_len={self.max_seq_len}; "
                    f"raise max_seq_len, or opt in to overlong='split' (cut it into pieces of max_seq_len "
                    f"tokens) or overlong='truncate' (keep its first max_seq_len tokens)")

    def batches(self, documents: Iterable[tuple[int, int]]) -> Iterator[GlobalBatch]:
        """Global batches in stream order; lazy, so an endless stream is fine."""
        step = 0
        seq_id = 0
        sequences: list[tuple[int, int]] = []
        sources: list[tuple[int, int, int]] = []
        used_tokens = 0
        for source in self.pieces(documents):
            length = source[2]
            if used_tokens + length > self.tokens_per_step:
                yield GlobalBatch(step, tuple(sequences), tuple(sources))
                step += 1
                sequences, sources, used_tokens = [], [], 0
            sequences.append((seq_id, length))
            sources.append(source)
            used_tokens += length
            seq_id += 1
        if sequences:
            yield GlobalBatch(step, tuple(sequences), tuple(sources))
