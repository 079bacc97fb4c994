"""`dcp` with pipeline parallelism, mixed group sizes: waves of about equal-time groups.

1F1B needs every rank to run the same number of micro-batches, so every group runs exactly
one micro-batch per wave; a rank's step is then about Σ over waves of the wave's longest
group. The best plan makes every wave full (no rank idle) with groups of equal time, using
whatever CP sizes the sequences need, side by side:
- sizes per sequence as in the PP = 1 policy, then, for a target wave time τ, a sequence
  that alone outlasts τ moves to larger groups while that runs it faster (it would stretch
  its whole wave);
- waves are built one after another: the longest sequence left sets the wave's time
  τ_w = max(τ, its alone-time); its size class, then the others largest first, claim blocks
  of free ranks, each block one micro-batch packed from its class up to τ_w of work and the
  per-rank tokens that fit without recompute (longest sequences first, then shortest ones
  from the other end into the room left), topped up with the shortest sequences of smaller
  classes run at the block's size;
- a wave's blocks are laid out largest first from rank 0 (powers of two stay aligned, the
  non-power-of-two top size, if any, goes last); ranks left over run an empty micro-batch;
- τ is tried for the wave counts that the batch's rank-seconds and memory suggest, each
  corrected when the build overflows; candidates are scored on arrays and only the plan with
  the shortest timeline is turned into plan objects;
- under ZeRO-3 (`ModelShape.wave_uniform_relief`) a wave's micro-batches, idle fillers included,
  share one relief (the one that holds the wave's fullest micro-batch fastest, relief_pass.wave_relief),
  and the rooms of full recompute are tried for the wave counts below what the room without relief
  needs (every wave pays the weight gathers: fewer, fuller waves may win).
A class is its sequences sorted longest first and only its two ends are taken, so a block
is a few contiguous runs, packed by bisection and summed from prefix sums.
"""
from __future__ import annotations

import bisect
import math

import numpy as np

from dcp_megatron.planner.plan import NO_RECOMPUTE, Group, MicroBatch, Wave
from dcp_megatron.planner.layout import microbatch_from_sums
from dcp_megatron.planner.dcp.relief_pass import wave_relief
from dcp_megatron.planner.timeline import one_microbatch_makespan

WAVE_COUNT_CHOICES = 4      # wave counts tried from the fewest that hold the batch
TARGET_REFINEMENTS = 3      # builds per wave count, the target wave time corrected after each
LIGHTER_ROOMS = 2           # packing rooms of module reliefs tried beside the room without relief
FULL_ROOM_SLACK = 0.1       # a full-k room holds a wave's share of the tokens and this much more (uneven blocks)
FULL_ROOM_PATIENCE = 2      # full-k wave counts tried past the last one that shortened the plan


class _SizeClass:
    """Sequences of one CP size, longest first; [front, back) are still to be placed."""

    def __init__(self, k: int, members: np.ndarray, seqs) -> None:
        self.k, self.seqs = k, seqs
        self.members = members
        self.seconds = seqs.seconds[members]
        self.time_sums = np.concatenate(([0.0], np.cumsum(self.seconds))).tolist()
        self.token_sums = np.concatenate(([0.0], np.cumsum(seqs.local[members]))).tolist()
        self._terms: dict[int, list[np.ndarray]] = {}
        self.front, self.back = 0, members.size

    def empty(self) -> bool:
        return self.front >= self.back

    def longest_left(self) -> float:
        return float(self.seconds[self.front])

    def take(self, time_room: float, token_room: float) -> tuple[list[tuple], float, float]:
        """One micro-batch: the longest sequences that fit, then the shortest; at least one.
        Returns the runs taken (class, start, end) and the time and tokens used."""
        ts, ls, f = self.time_sums, self.token_sums, self.front
        n = min(bisect.bisect_right(ts, ts[f] + time_room, f, self.back + 1),
                bisect.bisect_right(ls, ls[f] + token_room, f, self.back + 1)) - 1 - f
        n = max(n, 1)
        self.front = f + n
        used_time, used_tokens = ts[f + n] - ts[f], ls[f + n] - ls[f]
        more, t, tok = self.take_shortest(time_room - used_time, token_room - used_tokens)
        return [(self, f, f + n)] + more, used_time + t, used_tokens + tok

    def take_shortest(self, time_room: float, token_room: float) -> tuple[list[tuple], float, float]:
        """The shortest sequences left that fit the rooms together (maybe none)."""
        ts, ls, f, b = self.time_sums, self.token_sums, self.front, self.back
        if f >= b or time_room <= 0 or token_room <= 0:
            return [], 0.0, 0.0
        lo = max(bisect.bisect_left(ts, ts[b] - time_room, f, b + 1),
                 bisect.bisect_left(ls, ls[b] - token_room, f, b + 1))
        self.back = lo
        return ([(self, lo, b)] if lo < b else []), ts[b] - ts[lo], ls[b] - ls[lo]

    def sums(self, start: int, end: int, size: int) -> tuple[float, float, float]:
        """Σ (local tokens, compute s, attention s) of members [start, end) at CP size `size`."""
        prefix = self._terms.get(size)
        if prefix is None:
            seqs = self.seqs
            if seqs.sizes[self.k] == size:
                parts = (seqs.local[self.members], seqs.compute[self.members], seqs.attn[self.members])
            else:
                parts = seqs.cost.doc_terms(seqs.lengths[self.members], size)
            prefix = self._terms[size] = np.cumsum(np.stack(parts), axis=1)
        if start == 0:
            return tuple(prefix[:, end - 1].tolist())
        return tuple((prefix[:, end - 1] - prefix[:, start - 1]).tolist())


def plan_mixed_waves(ids: np.ndarray, lengths: np.ndarray, cost, seqs) -> tuple[Wave, ...] | None:
    """The best mixed-size plan over a few target wave times; `seqs` a grown SizedSequences.
    None when every candidate has a block that no allowed recompute holds."""
    D = cost.cluster.domain_size
    size_arr = np.asarray(seqs.sizes)[seqs.idx]
    rank_seconds = float((seqs.seconds * size_arr).sum())
    local_sum = float((seqs.local * size_arr).sum())
    best, best_time = None, math.inf

    def attempt(cap: int, num_waves: int) -> None:
        nonlocal best, best_time
        target = rank_seconds / (D * num_waves)
        for _ in range(TARGET_REFINEMENTS):
            sized = seqs.copy()
            sized.grow_above(target, len(sized.sizes) - 1)
            waves = _build(_size_classes(ids, sized), sized.sizes, target, cap, D)
            laid = [_layout(blocks, D, cost) for blocks in waves]
            t = _makespan(laid, D, cost)
            if t < best_time * (1 - 1e-9):
                best, best_time = laid, t
            if len(waves) <= num_waves or math.isinf(t):
                break
            # more waves than meant (blocks end short of the target, packing costs more than
            # the alone-times say): stretch the target by the waves' overflow
            last = sum(block[0] * block[3] for block in laid[-1])
            target *= (len(waves) - 1 + last / (D * target)) / num_waves

    for cap, num_waves in _candidates(cost, local_sum, D):
        attempt(cap, num_waves)
    # ZeRO-3: every wave pays the weight gathers, so fewer, fuller waves with the wave's relief (full layers
    # shared by all its micro-batches) may win; wave counts downwards while they keep paying off
    misses = 0
    for cap, num_waves in _full_room_candidates(cost, local_sum, D):
        before = best_time
        attempt(cap, num_waves)
        misses = 0 if best_time < before * (1 - 1e-9) else misses + 1
        if misses >= FULL_ROOM_PATIENCE:
            break
    if best is None:
        return None
    return _waves(best, D, cost, list(zip(ids.tolist(), lengths.tolist())))


def packing_rooms(cost) -> list[int]:
    """Local-token rooms to pack micro-batches to: the room without (extra) relief first, then the rooms of the
    lightest module reliefs that hold more (e.g. MLP recompute). Fewer, fuller micro-batches with a cheap relief
    can beat more micro-batches without one: each pays the fixed per-micro-batch overhead, and in lockstep every
    micro-batch costs every rank a slot (under ZeRO-3 a weight gather). Each micro-batch's relief is still chosen
    by its own tokens (under ZeRO-3 each wave's, by its fullest micro-batch)."""
    rooms = [cost.max_local_tokens(cost.base_recompute)]
    for relief in cost.recompute_options():
        room = cost.max_local_tokens(relief) if relief.kind != "full" else 0
        if room > rooms[-1] * 1.05 and len(rooms) <= LIGHTER_ROOMS:
            rooms.append(room)
    return rooms


def _candidates(cost, local_token_sum: float, D: int) -> list[tuple[int, int]]:
    """(packing room in local tokens, number of waves) pairs to try (`packing_rooms`)."""
    out = []
    for cap in packing_rooms(cost):
        fewest = max(1, math.ceil(local_token_sum / (D * cap)))
        out += [(cap, n) for n in range(fewest, fewest + WAVE_COUNT_CHOICES)]
    return out


def _full_room_candidates(cost, local_token_sum: float, D: int) -> list[tuple[int, int]]:
    """Under ZeRO-3 (`ModelShape.wave_uniform_relief`) with full recompute allowed: (room, number of waves) for
    the wave counts below what the room without relief needs, most first, each with the room of the fewest full
    layers that holds a wave's share of the tokens with FULL_ROOM_SLACK to spare (the strongest room at most);
    pairs `_candidates` tries already are left out."""
    if not cost.model.wave_uniform_relief or "full" not in cost.allowed_recompute:
        return []
    rooms = [cost.max_local_tokens(r) for r in cost.full_recompute_options()]    # ascending
    below = max(1, math.ceil(local_token_sum / (D * packing_rooms(cost)[0])))
    fewest = max(1, math.ceil(local_token_sum / (D * rooms[-1])))
    tried = set(_candidates(cost, local_token_sum, D))
    out = []
    for n in range(below - 1, fewest - 1, -1):
        need = local_token_sum / (D * n) * (1 + FULL_ROOM_SLACK)
        room = next((r for r in rooms if r >= need), rooms[-1])
        if (room, n) not in tried:
            out.append((room, n))
    return out


def _size_classes(ids: np.ndarray, seqs) -> dict[int, _SizeClass]:
    classes = {}
    for k in range(len(seqs.sizes)):
        members = np.flatnonzero(seqs.idx == k)
        if members.size:
            classes[k] = _SizeClass(k, members[np.lexsort((ids[members], -seqs.seconds[members]))], seqs)
    return classes


def _build(classes: dict, sizes: list[int], target: float, cap_none: int, D: int) -> list[list[tuple]]:
    """Waves, each a list of blocks (size, runs)."""
    by_size = sorted(classes, reverse=True)
    waves = []
    while True:
        left = [k for k in by_size if not classes[k].empty()]
        if not left:
            return waves
        first = max(left, key=lambda k: (classes[k].longest_left(), k))
        wave_time = max(target, classes[first].longest_left())
        free = D
        blocks = []
        for k in [first] + [k for k in left if k != first]:
            cls, size = classes[k], sizes[k]
            while not cls.empty() and free >= size:
                runs, used_time, used_tokens = cls.take(wave_time, cap_none)
                # top the block up with the shortest sequences of smaller sizes, run at this
                # size (≈ the same rank-seconds, so time and tokens scale by their size / this)
                for small in by_size:
                    if sizes[small] < size and not classes[small].empty():
                        scale = size / sizes[small]
                        more, t, tok = classes[small].take_shortest((wave_time - used_time) * scale,
                                                                    (cap_none - used_tokens) * scale)
                        runs += more
                        used_time, used_tokens = used_time + t / scale, used_tokens + tok / scale
                blocks.append((size, runs))
                free -= size
        waves.append(blocks)


def _layout(blocks: list[tuple], D: int, cost) -> list[tuple]:
    """(size, first rank, runs, est. seconds, sums, relief) per block: powers of two largest first from
    rank 0 (aligned), then any other size. Each block's relief is the fastest that holds it, or under ZeRO-3
    the wave's (`relief_pass.wave_relief`)."""
    blocks.sort(key=lambda b: (b[0] & (b[0] - 1) != 0, -b[0]))
    out, rank = [], 0
    for size, runs in blocks:
        sums = [sum(part) for part in zip(*(cls.sums(start, end, size) for cls, start, end in runs))]
        out.append([size, rank, runs, 0.0, sums, None])
        rank += size
    if cost.model.wave_uniform_relief and out:
        local, compute, attn = (np.array([b[4][i] for b in out]) for i in range(3))
        relief, times = wave_relief(cost, local, compute, attn, np.array([b[0] for b in out]),
                                    np.array([b[1] for b in out]))
        for block, t in zip(out, times.tolist()):
            block[3], block[5] = t, relief
        return [tuple(b) for b in out]
    for block in out:
        size, first, _, _, (local, compute, attn), _ = block
        recompute = cost.choose_recompute(local, compute, attn, size)
        # topped-up blocks may pass the token room by padding; when no allowed recompute holds
        # the block, the candidate loses (infinite time)
        block[3] = math.inf if recompute is None else cost.time_from_sums(local, compute, attn, size, first, recompute)
        block[5] = recompute
    return [tuple(b) for b in out]


def _makespan(laid: list[list[tuple]], D: int, cost) -> float:
    wave_of, first_of, size_of, times = [], [], [], []
    for w, blocks in enumerate(laid):
        used = 0
        for size, first, _, t, _, _ in blocks:
            wave_of.append(w), first_of.append(first), size_of.append(size), times.append(t)
            used = first + size
        for rank in range(used, D):                   # idle ranks run an empty micro-batch
            wave_of.append(w), first_of.append(rank), size_of.append(1)
            times.append(cost.cluster.microbatch_overhead_s)
    return one_microbatch_makespan(*(np.asarray(x) for x in (wave_of, first_of, size_of, times)), D)


def _waves(laid: list[list[tuple]], D: int, cost, pairs: list) -> tuple[Wave, ...]:
    waves = []
    for blocks in laid:
        groups, rank = [], 0
        for size, first, runs, _, sums, relief in blocks:
            seqs = tuple(pairs[i] for cls, start, end in runs for i in cls.members[start:end].tolist())
            groups.append(Group(first, size, (microbatch_from_sums(cost, seqs, *sums, size, first, relief),)))
            rank = first + size
        # idle ranks run an empty micro-batch; under ZeRO-3 with the wave's relief (they join its gathers)
        filler = blocks[0][5] if cost.model.wave_uniform_relief and blocks else NO_RECOMPUTE
        idle = MicroBatch((), filler, est_time_s=cost.cluster.microbatch_overhead_s, est_mem_bytes=cost.static_bytes)
        groups.extend(Group(r, 1, (idle,)) for r in range(rank, D))
        waves.append(Wave(tuple(groups)))
    return tuple(waves)
