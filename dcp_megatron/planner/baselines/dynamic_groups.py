"""The groups of one CP size in megatron-dynamic's micro-batch (megatron_dynamic.py), searchable without a scan.

The scheduler asks, per sequence and size, for the first group (creation order) with room for the sequence whose
workload after joining stays within a limit, and when none, for the group of least workload after joining. A scan
of every group made that O(sequences x groups) (about 3 s of a 3.2 s plan at D = 8,192). Here the groups are cut
in blocks of BLOCK, the blocks in runs of RUN, each block and run with its least packed tokens and least
workload: one whose minima fail the test holds no answer and is skipped whole. The answers are the scan's, float
for float (the same IEEE additions, the first found on ties). Plain lists: per query the work is a few dozen
comparisons, below numpy's call overhead. Minima only go stale low (values only grow), which skips less, never
wrongly.
"""
from __future__ import annotations

import math

BLOCK = 64
RUN = 8                 # blocks per run


class SizeGroups:
    """Groups of one CP size, in creation order: local index j, the scheduler's group id `ids[j]`."""

    def __init__(self):
        self.packed: list[int] = []
        self.work: list[float] = []
        self.block_packed: list[int] = []     # per block of BLOCK groups
        self.block_work: list[float] = []
        self.run_packed: list[int] = []       # per run of BLOCK blocks
        self.run_work: list[float] = []
        self.ids: list[int] = []

    def add(self, group_id: int) -> int:
        """A new empty group (packed 0, workload 0.0); its local index."""
        j = len(self.ids)
        self.ids.append(group_id)
        self.packed.append(0)
        self.work.append(0.0)
        b = j // BLOCK
        for level_packed, level_work, i in ((self.block_packed, self.block_work, b),
                                            (self.run_packed, self.run_work, b // RUN)):
            if i == len(level_packed):
                level_packed.append(0)
                level_work.append(0.0)
            else:
                level_packed[i], level_work[i] = 0, min(level_work[i], 0.0)
        return j

    def join(self, j: int, tokens: int, workload: float) -> None:
        packed, work = self.packed, self.work
        b = j // BLOCK
        r = b // RUN
        lo = b * BLOCK
        if packed[j] == self.block_packed[b]:      # a block's minimum moves only when its holder's did
            packed[j] += tokens
            self.block_packed[b] = min(packed[lo:lo + BLOCK])
            self.run_packed[r] = min(self.block_packed[r * RUN:r * RUN + RUN])
        else:
            packed[j] += tokens
        if work[j] == self.block_work[b]:
            work[j] += workload
            self.block_work[b] = min(work[lo:lo + BLOCK])
            self.run_work[r] = min(self.block_work[r * RUN:r * RUN + RUN])
        else:
            work[j] += workload

    def _blocks(self, room: int, workload: float, limit: float):
        """Blocks, in order, whose minima (and their run's) pass the test."""
        block_packed, block_work, run_work = self.block_packed, self.block_work, self.run_work
        for r, least_packed in enumerate(self.run_packed):
            if least_packed <= room and run_work[r] + workload <= limit:
                for b in range(r * RUN, min(r * RUN + RUN, len(block_packed))):
                    if block_packed[b] <= room and block_work[b] + workload <= limit:
                        yield b

    def first_within(self, room: int, workload: float, limit: float) -> int:
        """The first group with packed <= room and work + workload <= limit; -1 when none."""
        packed, work, block_packed, block_work, run_work = (self.packed, self.work, self.block_packed,
                                                            self.block_work, self.run_work)
        for r, least_packed in enumerate(self.run_packed):          # _blocks, inlined (the hot path)
            if least_packed <= room and run_work[r] + workload <= limit:
                for b in range(r * RUN, min(r * RUN + RUN, len(block_packed))):
                    if block_packed[b] <= room and block_work[b] + workload <= limit:
                        lo = b * BLOCK
                        for j in range(lo, min(lo + BLOCK, len(packed))):
                            if packed[j] <= room and work[j] + workload <= limit:
                                return j
        return -1

    def least_after(self, room: int, workload: float, limit: float) -> tuple[float, int] | None:
        """(work + workload, j) least over the groups with packed <= room and work + workload <= limit, the first
        on ties; None when none. Blocks are read from the least block minimum up, until none can do better."""
        packed, work, block_work = self.packed, self.work, self.block_work
        best, best_j = math.inf, -1
        for least_work, b in sorted((block_work[b], b) for b in self._blocks(room, workload, limit)):
            if least_work + workload > best:
                break
            lo = b * BLOCK
            for j in range(lo, min(lo + BLOCK, len(packed))):
                after = work[j] + workload
                if packed[j] <= room and after <= limit and (after < best or (after == best and j < best_j)):
                    best, best_j = after, j
        return None if best_j < 0 else (best, best_j)
