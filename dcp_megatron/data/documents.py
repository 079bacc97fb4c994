"""Document sources: whole documents, addressed by id, lengths known without reading tokens.

Convention (used by the batches and the assembly): a document of n tokens has n - 1
training positions. A sequence piece at token offset o with planned length L feeds inputs
doc[o : o + L] and labels doc[o + 1 : o + L + 1]; a whole document is the piece (0, n - 1).
So the planner's length of a document is `length(doc_id) - 1`, and a document needs at least
two tokens to train at all (`MIN_DOCUMENT_TOKENS`).

Sources implementing the protocol: `IndexedDocuments` (dcp_megatron/megatron/
indexed_documents.py, a reader over megatron-core's .bin/.idx), `MockDocuments` and
`InMemoryDocuments` below.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

MIN_DOCUMENT_TOKENS = 2


@runtime_checkable
class DocumentSource(Protocol):
    """What the data stream and the assembly need from a corpus."""

    @property
    def num_documents(self) -> int: ...

    def length(self, doc_id: int) -> int:
        """Number of tokens of the document (not of training positions); from the index, no token reads."""

    def lengths(self) -> np.ndarray:
        """int64 [num_documents]: `length` of every document, in id order."""

    def tokens(self, doc_id: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """int64 token ids doc[start:stop]; reads only that range."""


def check_doc_id(doc_id: int, num_documents: int) -> int:
    if isinstance(doc_id, bool) or not isinstance(doc_id, (int, np.integer)) or not 0 <= doc_id < num_documents:
        raise ValueError(f"document id {doc_id!r} outside [0, {num_documents})")
    return int(doc_id)


def check_token_range(doc_id: int, num_tokens: int, start: int, stop: int | None) -> tuple[int, int]:
    stop = num_tokens if stop is None else stop
    if not 0 <= start <= stop <= num_tokens:
        raise ValueError(f"token range [{start}, {stop}) outside document {doc_id} of {num_tokens} tokens")
    return int(start), int(stop)


class TokenCountIndex:
    """`length`/`lengths` of a source that keeps every document's token count in `_token_counts`
    (int64 numpy array) and knows `num_documents`; shared by every DocumentSource here."""

    _token_counts: np.ndarray

    def length(self, doc_id: int) -> int:
        return int(self._token_counts[check_doc_id(doc_id, self.num_documents)])

    def lengths(self) -> np.ndarray:
        return self._token_counts.copy()

    def _checked_range(self, doc_id: int, start: int, stop: int | None) -> tuple[int, int, int]:
        """(doc_id, start, stop) after checking the id and the token range against the index."""
        doc_id = check_doc_id(doc_id, self.num_documents)
        start, stop = check_token_range(doc_id, int(self._token_counts[doc_id]), start, stop)
        return doc_id, start, stop


@dataclass(frozen=True, kw_only=True)
class MockDocuments(TokenCountIndex):
    """Deterministic synthetic corpus with long-tailed document lengths.

    Planned (training) lengths follow the built-in `distribution` (default "wikipedia", see
    dcp_megatron/planner/distributions.py) restricted to [1, max_len]: draws above max_len
    are skipped, not clipped, so the shape below the cap is kept and no spike forms at it.
    `max_len` is therefore the run's `--seq-length` as is; a document has planned length + 1
    tokens. Tokens of document d come from a generator seeded by (seed, d), so any rank can
    read any document without reading the others.
    """

    seed: int
    num_documents: int
    max_len: int
    vocab_size: int
    distribution: str = "wikipedia"

    def __post_init__(self) -> None:
        for name in ("seed", "num_documents", "max_len", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"MockDocuments.{name} must be an int, got {value!r}")
        if self.seed < 0:
            raise ValueError(f"MockDocuments.seed must be >= 0, got {self.seed}")
        if self.num_documents <= 0:
            raise ValueError(f"MockDocuments.num_documents must be >= 1, got {self.num_documents}")
        if self.max_len < 1:
            raise ValueError(f"MockDocuments.max_len must be >= 1 (a training length), got {self.max_len}")
        if self.vocab_size < 2:
            raise ValueError(f"MockDocuments.vocab_size must be >= 2, got {self.vocab_size}")
        from dcp_megatron.planner.distributions import BUILTIN_NAMES
        if self.distribution not in BUILTIN_NAMES:
            raise ValueError(f"MockDocuments.distribution={self.distribution!r}; choose one of {list(BUILTIN_NAMES)}")
        # Cached on the frozen instance: lengths are drawn once, tokens on demand.
        object.__setattr__(self, "_token_counts", self._draw_token_counts())

    def _draw_token_counts(self) -> np.ndarray:
        from dcp_megatron.planner.distributions import iter_builtin_lengths
        counts = np.empty(self.num_documents, dtype=np.int64)
        filled = 0
        drawn = 0
        # Skipping draws over the cap: bounded so that a cap below every length of the
        # distribution ends with an error instead of a silent endless loop.
        draw_limit = 1000 * self.num_documents + 100_000
        for planned in iter_builtin_lengths(self.distribution, self.seed):
            drawn += 1
            if planned <= self.max_len:
                counts[filled] = planned + 1
                filled += 1
                if filled == self.num_documents:
                    return counts
            if drawn >= draw_limit:
                break
        raise ValueError(f"MockDocuments: distribution {self.distribution!r} yields almost no lengths "
                         f"<= max_len={self.max_len}; raise max_len or choose another distribution")

    def tokens(self, doc_id: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        doc_id, start, stop = self._checked_range(doc_id, start, stop)
        rng = np.random.default_rng([self.seed, doc_id])
        num_tokens = int(self._token_counts[doc_id])
        return rng.integers(0, self.vocab_size, size=num_tokens, dtype=np.int64)[start:stop]


class InMemoryDocuments(TokenCountIndex):
    """`DocumentSource` over token arrays held in memory (small corpora, tests, tools)."""

    def __init__(self, documents) -> None:
        self._documents = [np.asarray(doc, dtype=np.int64) for doc in documents]
        for doc_id, doc in enumerate(self._documents):
            if doc.ndim != 1:
                raise ValueError(f"document {doc_id} must be a 1-D token array, got shape {doc.shape}")
        self._token_counts = np.array([doc.size for doc in self._documents], dtype=np.int64)

    @property
    def num_documents(self) -> int:
        return len(self._documents)

    def tokens(self, doc_id: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        doc_id, start, stop = self._checked_range(doc_id, start, stop)
        return self._documents[doc_id][start:stop].copy()
