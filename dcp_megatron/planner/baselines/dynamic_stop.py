"""When dcp's megatron-dynamic seed cannot win: the scheduler (megatron_dynamic.py) stops as soon as this says so.

dcp plans megatron-dynamic as a seed that must beat its best plan so far (`must_beat`); a plan that ends at or after
it is dropped. `EndsTooLate` is asked after each wave and a few times while one is being made, and answers True only
when the whole plan would surely end at or after must_beat, so stopping returns exactly what scheduling on would.
"""
from __future__ import annotations

import itertools

import numpy as np

TOP_GROUPS = 8          # the groups with the most compute whose growth `EndsTooLate.unfinished` bounds


class EndsTooLate:
    """Called with each wave's groups as the scheduler makes them: True once the waves so far end at or after
    `must_beat` (plus a margin far above rounding). Waves only add time to a rank (`timeline.rank_finish_times`),
    so the whole plan would end then too and `plan_megatron_dynamic` would drop it: stopping early returns what it
    would have. Idle ranks are left out (they add nothing, or a filler's time in lockstep: only later ends)."""

    MARGIN = 1e-6        # relative; the dropping test's is 1e-9 and these sums may round differently

    def __init__(self, lengths, cost, recompute, must_beat: float) -> None:
        self.lengths, self.cost, self.recompute = lengths, cost, recompute
        self.limit = must_beat * (1 + self.MARGIN)
        self.finish = np.zeros(cost.cluster.domain_size)
        self.terms: dict[int, np.ndarray] = {}         # per CP size: (3, documents) local, compute, attention
        self.rebuilt = None                            # (a wave's sequences, its full-domain rebuild's least compute)

    def __call__(self, groups) -> bool:
        sizes, sums = self._sums(groups)
        ends = np.cumsum(sizes)
        firsts = ends - sizes
        times = self.cost.times_from_sums(sums[0], sums[1], sums[2], sizes, firsts, self.recompute)
        start = np.maximum.reduceat(self.finish[:ends[-1]], firsts)
        self.finish[:ends[-1]] = np.repeat(start + times, sizes)
        return float(self.finish.max()) >= self.limit

    def _terms(self, size: int) -> np.ndarray:
        if size not in self.terms:
            self.terms[size] = np.array(self.cost.doc_terms(self.lengths, size))
        return self.terms[size]

    def _sums(self, groups) -> tuple[np.ndarray, np.ndarray]:
        """(CP sizes, (3, groups) sums of local tokens, compute and attention seconds) of (size, members) groups."""
        sizes = np.array([s for s, _ in groups], dtype=np.int64)
        counts = [len(m) for _, m in groups]
        members = np.fromiter(itertools.chain.from_iterable(m for _, m in groups), dtype=np.int64, count=sum(counts))
        group_of = np.repeat(np.arange(len(groups)), counts)
        size_of = sizes[group_of]
        sums = np.zeros((3, len(groups)))
        for s in np.unique(sizes).tolist():
            sel = size_of == s
            for row, part in zip(sums, self._terms(s)[:, members[sel]]):
                row += np.bincount(group_of[sel], weights=part, minlength=len(groups))
        return sizes, sums

    def unfinished(self, groups, free: int, sizes: list[int], order: list[int], top_share, cap: int) -> bool:
        """True when a wave still being made cannot end in time. Its groups start no sooner than the earliest rank is
        free, and a micro-batch takes at least the overhead and its documents' compute (what it adds, relief, MoE
        and CP communication, is never negative; measured time factors may shrink it, so then this never stops).
        A group keeps its size unless the fill-up growth reaches it: that grows the smallest group first, so
        before a group of size v grows every smaller one must reach v, and the `free` ranks (fewer later) must pay
        for that and its own growth (to grow from size a to b a group must be the smallest: every other one at a or
        more): it takes at least its compute at the cheapest size it may reach. The wave may instead be rebuilt as
        one full-domain group (`top_share` not None): of `order`'s sequences those that fit in turn, its time known
        as soon as the wave starts."""
        if self.cost.time_scale:
            return False
        have, sums = self._sums(groups)
        overhead, start = self.cost.cluster.microbatch_overhead_s, float(self.finish.min())
        least = 0.0
        for g in np.argsort(-sums[1], kind="stable")[:TOP_GROUPS].tolist():
            if sums[1][g] <= least:
                break
            v, members, cheapest = int(have[g]), groups[g][1], float(sums[1][g])
            for prev, u in zip(sizes, sizes[1:]):
                if u <= v:
                    continue
                # to grow from prev to u it must be the smallest group: every other one at prev or more
                if int(np.maximum(prev - have, 0).sum()) - (prev - v) + (u - v) > free:
                    break
                cheapest = min(cheapest, float(self.cost.doc_terms(self.lengths[members], u)[1].sum()))
            least = max(least, cheapest)
        if top_share is not None:
            if self.rebuilt is None or self.rebuilt[0] is not order:
                chosen, left = [], cap
                for i in order:
                    if top_share[i] <= left:
                        chosen.append(i)
                        left -= top_share[i]
                D = self.cost.cluster.domain_size
                terms = self.cost.doc_terms(self.lengths[chosen], D)
                local, compute, attn = (np.array([float(x.sum())]) for x in terms)
                self.rebuilt = (order, float(self.cost.times_from_sums(local, compute, attn, D, np.zeros(1, np.int64),
                                                                       self.recompute)[0]))
            # the rebuilt wave's one group starts when every rank is free
            return min(start + overhead + least, float(self.finish.max()) + self.rebuilt[1]) >= self.limit
        return start + overhead + least >= self.limit
