"""dcp's first-fit packing of many blocks at once, in numpy rounds (the same chunks and sums as the Python loop).

`own_layout._next_fit` packs one block's sequences (longest first) into micro-batches of at most `room` local
tokens, each sequence into the first open micro-batch it fits, and the micro-batches' estimates take Python's
`sum` of their sequences' terms. At tens of thousands of blocks that is a Python loop per sequence;
`first_fit_rounds` decides position p of every block in one round (so as many rounds as the longest block has
sequences), adding the same floats in the same order, and `python_sums` gives each chunk's `sum()` float for
float: CPython 3.12 adds floats with Neumaier's compensation (bltinmodule.c), replayed here element-wise.
"""
from __future__ import annotations

import numpy as np

# below this many blocks a size class packs in the Python loop (a round costs tens of µs of numpy calls)
MIN_BLOCKS = 64


def first_fit_rounds(local: np.ndarray, lows: np.ndarray, counts: np.ndarray, room: float) -> np.ndarray:
    """Chunk index (within its block) of each item: block b holds items lows[b] .. lows[b] + counts[b] - 1 of
    `local` (per item local tokens, in the block's packing order); the same as `own_layout._next_fit`."""
    chunk = np.zeros(local.size, dtype=np.int64)
    if not counts.size:
        return chunk
    order = np.argsort(-counts, kind="stable")      # most items first: each round's blocks are a prefix
    starts, sizes = lows[order], counts[order]
    width = 4
    used = np.zeros((counts.size, width))            # local tokens per open chunk; 0.0 where not open yet
    opened = np.zeros(counts.size, dtype=np.int64)
    for p in range(1, int(sizes[0])):                # item 0 of every block opens chunk 0
        if p == 1:
            used[:, 0] = local[starts]
            opened[:] = 1
        active = int(np.searchsorted(-sizes, -p, side="left"))     # blocks with more than p items
        if int(opened[:active].max()) >= width:
            used = np.hstack([used, np.zeros((counts.size, width))])
            width *= 2
        where = starts[:active] + p
        x = local[where]
        fits = used[:active] + x[:, None] <= room   # the first unopened column is 0.0 + x: a new chunk
        j = np.where(fits.any(axis=1), fits.argmax(axis=1), opened[:active])
        rows = np.arange(active)
        used[rows, j] += x
        np.maximum(opened[:active], j + 1, out=opened[:active])
        chunk[where] = j
    return chunk


def python_sums(values: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """`sum(values[s:s + n].tolist())` for each (s, n), rows of `values` (shape (rows, items)) at once: Python's
    float sum, the first item then each next one with Neumaier's compensation, the compensation added last."""
    out = np.empty((values.shape[0], counts.size))
    if not counts.size:
        return out
    order = np.argsort(-counts, kind="stable")
    starts, sizes = starts[order], counts[order]
    total = values[:, starts].copy()
    comp = np.zeros_like(total)
    for p in range(1, int(sizes[0])):
        active = int(np.searchsorted(-sizes, -p, side="left"))
        x = values[:, starts[:active] + p]
        f = total[:, :active]
        t = f + x
        comp[:, :active] += np.where(np.abs(f) >= np.abs(x), (f - t) + x, (x - t) + f)
        total[:, :active] = t
    total = np.where((comp != 0) & np.isfinite(comp), total + comp, total)
    out[:, order] = total
    return out


def numpy_sums(values: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """`float(values[r, s:s + n].sum())` for each (s, n) and row r, at once: numpy's pairwise sum of a contiguous
    float64 array (numpy/_core/src/umath/loops_utils.h: under 8 items one after another; up to 128 eight running
    sums over blocks of 8, combined pairwise, then the rest one after another); longer ones call numpy."""
    out = np.empty((values.shape[0], counts.size))
    small, mid = np.flatnonzero(counts < 8), np.flatnonzero((counts >= 8) & (counts <= 128))
    if small.size:
        out[:, small] = _sequential(values, starts[small], counts[small], values[:, starts[small]])
    if mid.size:
        first, blocks = starts[mid], counts[mid] // 8
        run = values[:, first[:, None] + np.arange(8)]             # (rows, chunks, 8): the eight running sums
        for q in range(1, int(blocks.max())):
            active = np.flatnonzero(blocks > q)
            run[:, active] += values[:, first[active, None] + 8 * q + np.arange(8)]
        total = ((run[..., 0] + run[..., 1]) + (run[..., 2] + run[..., 3])) + (
            (run[..., 4] + run[..., 5]) + (run[..., 6] + run[..., 7]))
        out[:, mid] = _sequential(values, first + 8 * blocks, counts[mid] - 8 * blocks, total, start=0)
    for c in np.flatnonzero(counts > 128).tolist():
        out[:, c] = [float(row[starts[c]:starts[c] + counts[c]].sum()) for row in values]
    return out


def _sequential(values: np.ndarray, starts: np.ndarray, counts: np.ndarray, total: np.ndarray,
                start: int = 1) -> np.ndarray:
    """total + values[:, s + start], + values[:, s + start + 1], ... up to s + n - 1, one after another."""
    total = total.copy()
    for p in range(start, int(counts.max()) if counts.size else 0):
        active = np.flatnonzero(counts > p)
        total[:, active] += values[:, starts[active] + p]
    return total
