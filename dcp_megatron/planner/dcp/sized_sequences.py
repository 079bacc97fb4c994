"""Per sequence of a step: the index of its CP size and its alone-time pieces at that size (the dcp policy's state
while it grows groups; shared by its wave and pipeline planners)."""
from __future__ import annotations

import heapq

import numpy as np


class SizedSequences:
    """Per sequence: index of its CP size and its alone-time pieces at that size."""

    def __init__(self, lengths: np.ndarray, sizes: list[int], idx: np.ndarray, cost) -> None:
        self.lengths, self.sizes, self.cost = lengths, sizes, cost
        self.idx = idx.copy()
        n = lengths.size
        self.local, self.compute, self.attn, self.seconds = (np.zeros(n) for _ in range(4))
        self._refresh(np.arange(n))

    def _refresh(self, which: np.ndarray) -> None:
        for k in np.unique(self.idx[which]).tolist():
            sel = which[self.idx[which] == k]
            parts = self.cost.doc_alone_seconds(self.lengths[sel], self.sizes[k])
            for arr, part in zip((self.local, self.compute, self.attn, self.seconds), parts):
                arr[sel] = part

    def rank_seconds(self) -> float:
        return float((self.seconds * np.asarray(self.sizes)[self.idx]).sum())

    def move(self, which: np.ndarray, new_idx: np.ndarray) -> None:
        self.idx[which] = new_idx
        self._refresh(which)

    def copy(self) -> "SizedSequences":
        return self.subset(np.arange(self.lengths.size))

    def subset(self, keep: np.ndarray) -> "SizedSequences":
        """The sequences at indices `keep` (copies; same sizes and terms, no re-scoring)."""
        other = object.__new__(SizedSequences)
        other.lengths, other.sizes, other.cost = self.lengths[keep], self.sizes, self.cost
        other.idx, other.local, other.compute, other.attn, other.seconds = (
            x[keep] for x in (self.idx, self.local, self.compute, self.attn, self.seconds))
        return other

    def grow_above(self, time_limit: float, allowed_top: int) -> None:
        """Larger groups, size by size, for sequences that alone take longer than `time_limit`
        while the next size runs them faster (with PP a sequence longer than the wave time
        stretches its whole wave)."""
        for k in range(allowed_top):
            sel = np.flatnonzero((self.idx == k) & (self.seconds > time_limit))
            if not sel.size:
                continue
            grown = self.cost.doc_alone_seconds(self.lengths[sel], self.sizes[k + 1])[3]
            faster = grown < self.seconds[sel] * (1 - 1e-3)
            if faster.any():
                self.move(sel[faster], np.full(int(faster.sum()), k + 1))

    def grow_cheaper(self, allowed_top: int) -> bool:
        """Sequences that need recompute where they sit move up a size while that costs fewer
        rank-seconds: fewer local tokens can drop the recompute (e.g. 1.8K tokens with full
        recompute on one rank vs 0.9K tokens each on two ranks, without). True if any moved."""
        room = self.cost.max_local_tokens(self.cost.base_recompute)
        moved = False
        for k in range(allowed_top):
            sel = np.flatnonzero((self.idx == k) & (self.local > room))
            if not sel.size:
                continue
            grown = self.cost.doc_alone_seconds(self.lengths[sel], self.sizes[k + 1])[3]
            cheaper = grown * self.sizes[k + 1] < self.seconds[sel] * self.sizes[k] * (1 - 1e-3)
            if cheaper.any():
                self.move(sel[cheaper], np.full(int(cheaper.sum()), k + 1))
                moved = True
        return moved

    def grow_long_sequences(self, domain_size: int, allowed_top: int) -> None:
        """Larger groups for sequences that alone outlast the balanced step, while that lowers
        the step estimate max(balanced rank-seconds / D, longest alone-time)."""
        sizes = self.sizes
        rank_seconds = self.rank_seconds()
        cand = np.flatnonzero((self.seconds > rank_seconds / domain_size) & (self.idx < allowed_top))
        if not cand.size:
            return
        cand = cand[np.argsort(-self.seconds[cand], kind="stable")]
        # alone-time at every size, a column computed when the loop first needs it
        table = np.full((cand.size, len(self.sizes)), np.inf)
        table[np.arange(cand.size), self.idx[cand]] = self.seconds[cand]
        known = np.zeros(len(self.sizes), dtype=bool)
        others = np.delete(self.seconds, cand)
        longest_other = float(others.max()) if others.size else 0.0
        new_idx = self.idx[cand].tolist()
        heap = [(-t, j) for j, t in enumerate(self.seconds[cand].tolist())]     # longest first
        heapq.heapify(heap)
        while heap:
            neg_t, j = heap[0]
            t, k = -neg_t, new_idx[j]
            if k >= allowed_top:
                break
            if not known[k + 1]:
                sel = np.flatnonzero(self.idx[cand] < k + 1)
                table[sel, k + 1] = self.cost.doc_alone_seconds(self.lengths[cand[sel]], self.sizes[k + 1])[3]
                known[k + 1] = True
            t_next = float(table[j, k + 1])
            grown = rank_seconds + t_next * sizes[k + 1] - t * sizes[k]
            # Worth it while the sequence gets faster and the extra rank-seconds keep the
            # balanced level below the current longest time.
            if not (t_next < t * (1.0 - 1e-3) and grown / domain_size < max(t, longest_other)):
                break
            new_idx[j], rank_seconds = k + 1, grown
            heapq.heapreplace(heap, (-t_next, j))
        new_idx = np.asarray(new_idx, dtype=np.int64)
        moved = new_idx != self.idx[cand]
        if moved.any():
            self.move(cand[moved], new_idx[moved])
