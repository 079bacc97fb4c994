"""Which relief a micro-batch runs: the fastest on the run's menu that fits in memory (relief.py names the menu).

The options are the light reliefs (none, recompute modules, offload), most bytes kept first, then full recompute
of 1..n layers: `base_recompute` is what a micro-batch gets when memory is no issue, `strongest_recompute` the one
holding the most tokens. Memory usually falls along full 1..n, but not always: when a layer's backward (its
gradients beside one layer's tensors) is the peak rather than the loss's, recomputing the last layer too adds its
checkpoint to that peak (a small vocabulary: the tiny CPU models), so full n can count more than full n-1. Every
choice here takes the fewest layers that fit, never assuming the bytes fall. Time and bytes come from the cost model's two parts
(cost_time.py, cost_memory.py).
"""
from __future__ import annotations

import math

import numpy as np

from dcp_megatron.planner.plan import NO_RECOMPUTE, Recompute

MIN_BATCHED = 32       # best_reliefs_from_sums: from this many micro-batches on, one numpy call per relief


class ReliefChoice:
    """The relief options of a run and the choice among them; CostModel builds it and hands out its methods."""

    def __init__(self, time, memory, *, light: list[Recompute], full_options: list[Recompute],
                 allowed_recompute: tuple[str, ...]) -> None:
        self.time, self.memory, self.cluster = time, memory, memory.cluster
        self.allowed_recompute = allowed_recompute
        self._full_options = full_options
        self._light_options = light
        self._options = light + (full_options if "full" in allowed_recompute else [])
        if not self._options:     # offload alone: it moves tensors a relief keeps, and needs one to keep them
            raise ValueError(f"the recompute menu (--dcp-recompute; dcp-simulate --recompute) {','.join(allowed_recompute)} leaves no relief to run: offload moves "
                             f"tensors of layers that keep their modules (none) or recompute some, so name one "
                             f"beside it (e.g. {','.join(('none',) + tuple(allowed_recompute))})")
        # base: what a micro-batch gets when memory is no issue (none when allowed: the fastest);
        # strongest: the one holding the most tokens under the bound count (the last such option on a tie)
        self.base_recompute = self._options[0]
        per_token = memory.bytes_per_local_token
        self.strongest_recompute = self._options[min(range(len(self._options)),
                                                     key=lambda i: (per_token(self._options[i]), -i))]

    def full_recompute_options(self) -> list[Recompute]:
        """The full-recompute policies of 1..n layers, allowed or not: memory falls along the list."""
        return list(self._full_options)

    def recompute_options(self) -> list[Recompute]:
        """The allowed reliefs: the light ones (none, recompute modules, offload; relief.py) most bytes kept first,
        then full 1..n (memory falls along those)."""
        return list(self._options)

    def choose_recompute(self, local_tokens: float, compute_s: float, attn_s: float,
                         cp_size: int) -> Recompute | None:
        """`best_recompute_from_sums` with a shortcut for the common case: none when it fits (the fastest, unless
        measured corrections (`time_scale`) make another relief faster)."""
        if (self.base_recompute is NO_RECOMPUTE and not self.time.time_scale
                and local_tokens <= self.memory.max_local_tokens(NO_RECOMPUTE, cp_size)):
            return NO_RECOMPUTE
        return self.best_recompute_from_sums(local_tokens, compute_s, attn_s, cp_size)

    def best_recompute_from_sums(self, local_tokens: float, compute_s: float, attn_s: float,
                                 cp_size: int) -> Recompute | None:
        """Fastest allowed relief that fits: a light one (relief.py's menu) or the fewest full layers that fit."""
        fitting = self.fitting_reliefs(local_tokens, cp_size)
        if not fitting:
            return None
        time_from_sums = self.time.time_from_sums
        return min(fitting, key=lambda r: (time_from_sums(local_tokens, compute_s, attn_s, cp_size, 0, r)))

    def fitting_reliefs(self, local_tokens: float, cp_size: int | None = None) -> list[Recompute]:
        """The reliefs worth trying for a micro-batch of `local_tokens` per rank on a CP group of `cp_size` (None: any
        group): the light ones that fit and, unless none fits, the fewest full layers that fit (more layers only add
        time)."""
        room = self.cluster.mem_budget_bytes - self.memory.static_bytes
        per_token = self.memory.for_cp_size(cp_size).bytes_per_local_token
        fitting = [r for r in self._light_options if local_tokens * per_token(r) <= room]
        if "full" in self.allowed_recompute and (not fitting or fitting[0] is not NO_RECOMPUTE):
            k = self.fewest_full_layers(local_tokens, room, cp_size)
            if k is not None:
                fitting.append(self._full_options[k - 1])
        return fitting

    def fewest_full_layers(self, local_tokens: float, room: float, cp_size: int | None = None) -> int | None:
        """The fewest layers k of full recompute with which `local_tokens` per rank fit `room` bytes (None: none)."""
        full_bytes = self.memory.full_recompute_bytes(cp_size)
        if not self.memory.full_bytes_fall(cp_size):   # (module docstring) the first k = 1..n that fits
            fits = local_tokens * full_bytes <= room
            return int(fits.argmax()) + 1 if fits.any() else None
        # memory falls as k grows: the first k = 1..n whose bytes fit (bytes_per_local_token's floats)
        k = int(np.searchsorted(-full_bytes, -room / local_tokens, side="left")) if local_tokens else 0
        while k > 0 and local_tokens * full_bytes[k - 1] <= room:
            k -= 1                          # guard the division's rounding: step back while the product fits
        while k < len(self._full_options) and local_tokens * full_bytes[k] > room:
            k += 1
        return k + 1 if k < len(self._full_options) else None

    def doc_alone_seconds(self, lengths, cp_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Each document alone in a micro-batch at CP size c, placed at rank 0, with the fastest
        recompute that fits (inf where none does), without the per-micro-batch overhead.
        Returns (local tokens, compute s, attention s, seconds); vectorised for planning."""
        local, compute, attn = self.time.doc_terms(lengths, cp_size)
        seconds = self.time.alone_seconds(local, compute, attn, cp_size)
        overhead = self.cluster.microbatch_overhead_s
        if self.base_recompute is not NO_RECOMPUTE:
            return local, compute, attn, self._fastest_alone_seconds(local, compute, attn, cp_size) - overhead
        need = np.flatnonzero(local > self.memory.max_local_tokens(NO_RECOMPUTE, cp_size))
        if need.size:
            seconds[need] = self.best_reliefs_from_sums(local[need], compute[need], attn[need], cp_size,
                                                        np.zeros(need.size, dtype=np.int64))[1] - overhead
        return local, compute, attn, seconds

    def best_reliefs_from_sums(self, local, compute, attn, cp_size: int,
                               first_ranks) -> tuple[list[Recompute | None], np.ndarray]:
        """`best_recompute_from_sums` of many micro-batches (arrays of sums) on CP groups of `cp_size` from
        `first_ranks`, and `time_from_sums` of each with it (inf where none fits): the same choices and floats, each
        relief's times in one `times_from_sums` call where those are time_from_sums' floats (offload across ranks
        adds its terms in another order: one call a micro-batch)."""
        first_ranks = np.asarray(first_ranks, dtype=np.int64)
        if local.size < MIN_BATCHED:           # a few: one at a time is cheaper than a numpy call per relief
            reliefs = [self.best_recompute_from_sums(a, b, c, cp_size) for a, b, c in
                       zip(local.tolist(), compute.tolist(), attn.tolist())]
            return reliefs, np.array([math.inf if r is None else self.time.time_from_sums(a, b, c, cp_size, f, r)
                                      for r, a, b, c, f in zip(reliefs, local.tolist(), compute.tolist(),
                                                               attn.tolist(), first_ranks.tolist())])
        room = self.cluster.mem_budget_bytes - self.memory.static_bytes
        per_token = self.memory.for_cp_size(cp_size).bytes_per_local_token
        best, choice = np.full(local.shape, math.inf), np.full(local.shape, -1)
        any_light, none_first = np.zeros(local.shape, dtype=bool), np.zeros(local.shape, dtype=bool)
        tried: list[Recompute] = []

        def take(fits: np.ndarray, r: Recompute) -> None:
            sel = np.flatnonzero(fits)
            if not sel.size:
                return
            if r.offload and cp_size > 1:
                t = np.array([self.time.time_from_sums(a, b, c, cp_size, f, r) for a, b, c, f in
                              zip(local[sel].tolist(), compute[sel].tolist(), attn[sel].tolist(),
                                  first_ranks[sel].tolist())])
            else:
                t = self.time.times_from_sums(local[sel], compute[sel], attn[sel], cp_size, first_ranks[sel], r)
            better = t < best[sel]                   # strictly: the first fastest in the menu's order, as min()
            best[sel[better]], choice[sel[better]] = t[better], len(tried)
            tried.append(r)

        for r in self._light_options:            # fitting_reliefs' light ones, in its order
            fits = local * per_token(r) <= room
            if r is NO_RECOMPUTE:
                none_first |= fits & ~any_light
            any_light |= fits
            take(fits, r)
        if "full" in self.allowed_recompute:     # then the fewest full layers that fit, unless none is the first
            ks = np.zeros(local.shape, dtype=np.int64)
            for j in np.flatnonzero(~none_first).tolist():
                ks[j] = self.fewest_full_layers(float(local[j]), room, cp_size) or 0
            for k in np.unique(ks[ks > 0]).tolist():
                take(ks == k, self._full_options[k - 1])
        return [tried[c] if c >= 0 else None for c in choice.tolist()], best

    def _fastest_alone_seconds(self, local, compute, attn, cp_size: int) -> np.ndarray:
        """Per document alone at rank 0: the least time over the allowed recompute that fit."""
        room = self.cluster.mem_budget_bytes - self.memory.static_bytes
        first = np.zeros(local.shape, dtype=np.int64)
        best = np.full(local.shape, math.inf)
        for r in self._options:
            t = self.time.times_from_sums(local, compute, attn, cp_size, first, r)
            best = np.where((local * self.memory.bytes_per_local_token(r, cp_size) <= room) & (t < best), t, best)
        return best
