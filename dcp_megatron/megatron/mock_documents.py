"""Mock documents for `--mock-data`: deterministic, long-tailed lengths, learnable content.

Document d depends only on (seed, d): its length (log-normal, so most documents are short
and a few are long, capped so that its training positions fit the run's length cap) and its
tokens (a short random motif repeated, so the loss visibly falls as the model learns to
copy). Nothing depends on world size or layout, so runs with different layouts see the
same data. A document of n tokens has n - 1 training positions; that is its planned length.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch


@dataclass(frozen=True, kw_only=True)
class MockDocuments:
    seed: int
    vocab_size: int
    max_positions: int  # the run's length cap: a document has at most this many training positions
    median_positions: int = 0  # 0: an eighth of max_positions

    def __post_init__(self) -> None:
        if self.vocab_size < 2:
            raise ValueError(f"MockDocuments.vocab_size must be >= 2, got {self.vocab_size}")
        if self.max_positions < 1:
            raise ValueError(f"MockDocuments.max_positions must be >= 1, got {self.max_positions}")
        if self.median_positions < 0:
            raise ValueError(f"MockDocuments.median_positions must be >= 0, got {self.median_positions}")

    def _rng(self, document_id: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, document_id])

    def num_tokens(self, document_id: int) -> int:
        median = self.median_positions or max(1, self.max_positions // 8)
        positions = int(self._rng(document_id).lognormal(mean=np.log(median), sigma=1.0))
        return min(max(positions, 1), self.max_positions) + 1

    def tokens(self, document_id: int) -> torch.Tensor:
        rng = self._rng(document_id)
        n = self.num_tokens(document_id)
        rng.lognormal()  # keep the token stream independent of how the length was drawn
        motif = rng.integers(0, self.vocab_size, size=int(rng.integers(2, 9)))
        return torch.from_numpy(np.resize(motif, n).astype(np.int64))

    def planned_lengths(self, start: int = 0) -> Iterator[tuple[int, int]]:
        """Endless (document_id, training positions) stream, the batcher's input."""
        for document_id in itertools.count(start):
            yield document_id, self.num_tokens(document_id) - 1
