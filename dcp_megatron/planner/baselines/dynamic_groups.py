"""The groups of one CP size in megatron-dynamic's micro-batch (megatron_dynamic.py), searchable without a scan.

The scheduler asks, per sequence and size, for the first group (creation order) with room for the sequence whose
workload after joining stays within a limit, and when none, for the group of least workload after joining. A scan
of every group made that O(sequences x groups) (about 3 s of a 3.2 s plan at D = 8,192). Here the groups are cut
in blocks of BLOCK, each block with its least packed tokens and least workload: a block whose minima fail the test
holds no answer and is skipped whole. The answers are the scan's, float for float (the same IEEE additions, the
first found on ties). Plain lists: per query the work is a few dozen comparisons, below numpy's call overhead.
"""
from __future__ import annotations

import math

BLOCK = 64


class SizeGroups:
    """Groups of one CP size, in creation order: local index j, the scheduler's group id `ids[j]`."""

    def __init__(self):
        self.packed: list[int] = []
        self.work: list[float] = []
        self.block_packed: list[int] = []
        self.block_work: list[float] = []
        self.ids: list[int] = []

    def add(self, group_id: int) -> int:
        """A new empty group (packed 0, workload 0.0); its local index."""
        j = len(self.ids)
        self.ids.append(group_id)
        self.packed.append(0)
        self.work.append(0.0)
        if j % BLOCK == 0:
            self.block_packed.append(0)
            self.block_work.append(0.0)
        else:
            b = j // BLOCK
            self.block_packed[b], self.block_work[b] = 0, min(self.block_work[b], 0.0)
        return j

    def join(self, j: int, tokens: int, workload: float) -> None:
        b = j // BLOCK
        packed, work = self.packed, self.work
        was_least = packed[j] == self.block_packed[b], work[j] == self.block_work[b]
        packed[j] += tokens
        work[j] += workload
        lo = b * BLOCK
        if was_least[0]:                      # values only grow: a block's minimum moves only when its holder's did
            self.block_packed[b] = min(packed[lo:lo + BLOCK])
        if was_least[1]:
            self.block_work[b] = min(work[lo:lo + BLOCK])

    def first_within(self, room: int, workload: float, limit: float) -> int:
        """The first group with packed <= room and work + workload <= limit; -1 when none."""
        packed, work, block_work = self.packed, self.work, self.block_work
        for b, least_packed in enumerate(self.block_packed):
            if least_packed <= room and block_work[b] + workload <= limit:
                lo = b * BLOCK
                for j in range(lo, min(lo + BLOCK, len(packed))):
                    if packed[j] <= room and work[j] + workload <= limit:
                        return j
        return -1

    def least_after(self, room: int, workload: float, limit: float) -> tuple[float, int] | None:
        """(work + workload, j) least over the groups with packed <= room and work + workload <= limit, the first
        on ties; None when none. Blocks are read from the least block minimum up, until none can do better."""
        packed, work, block_work = self.packed, self.work, self.block_work
        blocks = sorted((block_work[b], b) for b, least_packed in enumerate(self.block_packed)
                        if least_packed <= room and block_work[b] + workload <= limit)
        best, best_j = math.inf, -1
        for least_work, b in blocks:
            if least_work + workload > best:
                break
            lo = b * BLOCK
            for j in range(lo, min(lo + BLOCK, len(packed))):
                after = work[j] + workload
                if packed[j] <= room and after <= limit and (after < best or (after == best and j < best_j)):
                    best, best_j = after, j
        return None if best_j < 0 else (best, best_j)
