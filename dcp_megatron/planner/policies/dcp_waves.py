"""`dcp` with pipeline parallelism, mixed group sizes: waves of about equal-time groups.

1F1B needs every rank to run the same number of micro-batches, so every group runs exactly
one micro-batch per wave; a rank's step is then about Σ over waves of the wave's longest
group. The best plan makes every wave full (no rank idle) with groups of equal time, using
whatever CP sizes the sequences need, side by side:
- sizes per sequence as in the PP = 1 policy (smallest that fits, long ones grown);
- for a target wave time τ, waves are built one after another: the longest sequence left
  sets the wave's time τ_w = max(τ, its alone-time); its size class, then the others
  largest first, claim blocks of free ranks, each block one micro-batch packed from its
  class up to τ_w of work and the per-rank tokens that fit without recompute (longest
  sequences first, then shortest ones from the other end into the room that is left);
- a wave's blocks are laid out largest first from rank 0 (powers of two stay aligned, the
  non-power-of-two top size, if any, goes last); ranks left over run an empty micro-batch;
- τ is tried for the wave counts that the batch's rank-seconds and memory suggest; the plan
  with the shortest timeline wins.
A class is a contiguous run of its sequences sorted longest first and only its two ends are
taken, so every packing step is a bisection on prefix sums.
"""
from __future__ import annotations

import bisect
import math

import numpy as np

from dcp_megatron.planner.plan import NO_RECOMPUTE, Group, MicroBatch, StepPlan, Wave
from dcp_megatron.planner.policies.common import microbatch_from_sums
from dcp_megatron.planner.timeline import plan_makespan

WAVE_COUNT_CHOICES = 6      # wave counts tried from the fewest that hold the batch
TARGET_REFINEMENTS = 3      # builds per wave count, the target wave time corrected after each


class _SizeClass:
    """Sequences of one CP size, longest first; [front, back) are still to be placed."""

    def __init__(self, members: np.ndarray, seconds: np.ndarray, local: np.ndarray) -> None:
        self.members = members.tolist()
        self.seconds = seconds
        self.time_sums = np.concatenate(([0.0], np.cumsum(seconds))).tolist()
        self.token_sums = np.concatenate(([0.0], np.cumsum(local))).tolist()
        self.front, self.back = 0, len(self.members)

    def empty(self) -> bool:
        return self.front >= self.back

    def longest_left(self) -> float:
        return float(self.seconds[self.front])

    def take(self, time_room: float, token_room: float) -> tuple[list[int], float, float]:
        """One micro-batch: the longest sequences that fit, then the shortest; at least one.
        Returns the sequences and the time and tokens used."""
        ts, ls, f = self.time_sums, self.token_sums, self.front
        n = min(bisect.bisect_right(ts, ts[f] + time_room, f, self.back + 1),
                bisect.bisect_right(ls, ls[f] + token_room, f, self.back + 1)) - 1 - f
        n = max(n, 1)
        self.front = f + n
        taken = self.members[f:f + n]
        used_time, used_tokens = ts[f + n] - ts[f], ls[f + n] - ls[f]
        more, t, tok = self.take_shortest(time_room - used_time, token_room - used_tokens)
        return taken + more, used_time + t, used_tokens + tok

    def take_shortest(self, time_room: float, token_room: float) -> tuple[list[int], float, float]:
        """The shortest sequences left that fit the rooms together (maybe none)."""
        ts, ls, f, b = self.time_sums, self.token_sums, self.front, self.back
        if f >= b or time_room <= 0 or token_room <= 0:
            return [], 0.0, 0.0
        lo = max(bisect.bisect_left(ts, ts[b] - time_room, f, b + 1),
                 bisect.bisect_left(ls, ls[b] - token_room, f, b + 1))
        self.back = lo
        return self.members[lo:b], ts[b] - ts[lo], ls[b] - ls[lo]


def plan_mixed_waves(ids: np.ndarray, lengths: np.ndarray, cost, seqs) -> tuple[Wave, ...]:
    """The best mixed-size plan over a few target wave times; `seqs` a grown SizedSequences."""
    D = cost.cluster.domain_size
    cap_none = cost.max_local_tokens(NO_RECOMPUTE)
    size_arr = np.asarray(seqs.sizes)[seqs.idx]
    rank_seconds = float((seqs.seconds * size_arr).sum())
    fewest = max(1, math.ceil(float((seqs.local * size_arr).sum()) / (D * cap_none)))
    pairs = list(zip(ids.tolist(), lengths.tolist()))
    best, best_time = None, math.inf
    for num_waves in range(fewest, fewest + WAVE_COUNT_CHOICES):
        target = rank_seconds / (D * num_waves)
        for _ in range(TARGET_REFINEMENTS):
            sized = seqs.copy()
            sized.grow_above(target, len(sized.sizes) - 1)
            waves = _build(_size_classes(ids, sized), sized.sizes, target, cap_none, D, cost, sized, pairs)
            t = plan_makespan(StepPlan(domain_size=D, waves=waves))
            if t < best_time * (1 - 1e-9):
                best, best_time = waves, t
            if len(waves) <= num_waves:
                break
            # more waves than meant (blocks end short of the target, packing costs more than
            # the alone-times say): stretch the target by the waves' overflow
            overflow = len(waves) - 1 + _busy_rank_seconds(waves[-1]) / (D * target)
            target *= overflow / num_waves
    return best


def _busy_rank_seconds(wave: Wave) -> float:
    return sum(g.size * g.microbatches[0].est_time_s for g in wave.groups if g.microbatches[0].sequences)


def _size_classes(ids: np.ndarray, seqs) -> dict[int, _SizeClass]:
    classes = {}
    for k in range(len(seqs.sizes)):
        members = np.flatnonzero(seqs.idx == k)
        if members.size:
            members = members[np.lexsort((ids[members], -seqs.seconds[members]))]
            classes[k] = _SizeClass(members, seqs.seconds[members], seqs.local[members])
    return classes


def _build(classes: dict, sizes: list[int], target: float, cap_none: int, D: int, cost, seqs,
           pairs: list) -> tuple[Wave, ...]:
    by_size = sorted(classes, reverse=True)
    waves = []
    while True:
        left = [k for k in by_size if not classes[k].empty()]
        if not left:
            break
        first = max(left, key=lambda k: (classes[k].longest_left(), k))
        wave_time = max(target, classes[first].longest_left())
        free = D
        blocks: list[tuple[int, list[int]]] = []
        for k in [first] + [k for k in left if k != first]:
            cls, size = classes[k], sizes[k]
            while not cls.empty() and free >= size:
                items, used_time, used_tokens = cls.take(wave_time, cap_none)
                # top the block up with the shortest sequences of smaller sizes, run at this
                # size (≈ the same rank-seconds, so time and tokens scale by their size / this)
                for small in by_size:
                    if sizes[small] < size and not classes[small].empty():
                        scale = size / sizes[small]
                        more, t, tok = classes[small].take_shortest((wave_time - used_time) * scale,
                                                                    (cap_none - used_tokens) * scale)
                        items += more
                        used_time, used_tokens = used_time + t / scale, used_tokens + tok / scale
                blocks.append((size, items))
                free -= size
        waves.append(_layout(blocks, D, cost, seqs, pairs))
    return tuple(waves)


def _layout(blocks: list[tuple[int, list[int]]], D: int, cost, seqs, pairs: list) -> Wave:
    """Powers of two largest first from rank 0 (aligned), then any other size, then idle ranks."""
    blocks.sort(key=lambda b: (b[0] & (b[0] - 1) != 0, -b[0]))
    groups, rank = [], 0
    for size, items in blocks:
        idx = np.asarray(items)
        if (seqs.idx[idx] == seqs.idx[idx[0]]).all() and seqs.sizes[seqs.idx[idx[0]]] == size:
            parts = (seqs.local[idx], seqs.compute[idx], seqs.attn[idx])
        else:                                   # topped up: every sequence's terms at this size
            parts = cost.doc_terms(seqs.lengths[idx], size)
        mb = microbatch_from_sums(cost, tuple(map(pairs.__getitem__, items)), *(float(p.sum()) for p in parts),
                                  size, rank)
        groups.append(Group(rank, size, (mb,)))
        rank += size
    idle = MicroBatch((), est_time_s=cost.cluster.microbatch_overhead_s, est_mem_bytes=cost.static_bytes)
    groups.extend(Group(r, 1, (idle,)) for r in range(rank, D))
    return Wave(tuple(groups))
