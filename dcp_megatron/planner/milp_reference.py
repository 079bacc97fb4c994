"""An exact reference for small batches: a MILP (HiGHS, optional) over one family of plans.

The family: every document longer than what one rank holds without recompute ("long") runs alone in a
micro-batch on an aligned power-of-two group (the groups the dcp policy uses on a power-of-two
domain), with the fastest recompute that fits there; its time is the cost model's, communication and
overhead included. The short documents ("filler") are divisible CP-1 work: their CP-1 compute plus
the overhead of the fewest CP-1 micro-batches that hold their tokens, spread over the ranks in any
proportion (a relaxation: a real plan packs whole documents).

    minimise T  s.t.  for every rank r:  sum over (long document i, group g holding r) t(i, g) x(i, g) + f_r <= T
                      sum_g x(i, g) = 1 (x binary),  sum_r f_r = F,  f_r >= 0

Aligned power-of-two blocks are laminar (two blocks are nested or disjoint), so running the larger
groups first realises any rank loads: the MILP value is the best step time of the family (up to the
filler relaxation). Any plan of the family therefore takes at least the MILP value, and the lower bound
(bounds.py) must never exceed it; a dcp plan whose long documents all run alone (each one's local tokens
over half the packing room at every size) is a plan of the family, so it cannot beat it either.

`highspy` is imported when a solve is asked for, so the planner imports without it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dcp_megatron.planner.layout import candidate_sizes
from dcp_megatron.planner.padding import padded_length


@dataclass(frozen=True)
class MilpResult:
    value_s: float          # best step time found (the optimum when `optimal`)
    dual_bound_s: float     # no plan of the family beats this (equals value_s when optimal)
    optimal: bool
    num_long: int           # documents modelled as binaries
    num_groups: int
    solve_s: float


def highspy_available() -> bool:
    try:
        import highspy  # noqa: F401
    except ImportError:
        return False
    return True


def aligned_groups(cost) -> list[tuple[int, int]]:
    """(size, first rank) of every aligned power-of-two group of the domain; ValueError when the
    domain size is not a power of two (the family is then not laminar)."""
    D = cost.cluster.domain_size
    if D & (D - 1):
        raise ValueError(f"the MILP reference needs a power-of-two domain, got {D} ranks")
    return [(c, off) for c in candidate_sizes(cost.cluster) for off in range(0, D - c + 1, c)]


def split_long(lengths: np.ndarray, cost) -> tuple[np.ndarray, np.ndarray]:
    """(long, filler) lengths: long ones exceed what one rank holds alone without recompute."""
    lengths = np.asarray(lengths, dtype=np.int64)
    room = cost.max_local_tokens(cost.base_recompute)
    long = padded_length(lengths, 1) > room
    return lengths[long], lengths[~long]


def filler_rank_seconds(filler: np.ndarray, cost) -> float:
    """CP-1 compute of the short documents plus the overhead of the fewest CP-1 micro-batches."""
    if filler.size == 0:
        return 0.0
    local, compute, _ = cost.doc_terms(filler, 1)
    room = cost.max_local_tokens(cost.base_recompute)
    return float(compute.sum()) + cost.cluster.microbatch_overhead_s * math.ceil(float(local.sum()) / room)


def group_times(long: np.ndarray, groups: list[tuple[int, int]], cost) -> np.ndarray:
    """t(i, g): seconds of long document i alone on group g with its fastest fitting recompute (inf: none fits).
    Aligned groups of one size are all inside a node or all across nodes, so one column per size is scored."""
    times = np.full((long.size, len(groups)), math.inf)
    by_size: dict[int, np.ndarray] = {}
    for j, (size, first) in enumerate(groups):
        if size not in by_size:
            column = np.full(long.size, math.inf)
            for i, length in enumerate(long.tolist()):
                recompute = cost.best_recompute([length], size)
                if recompute is not None:
                    column[i] = cost.microbatch_time([length], size, first_rank=first, recompute=recompute)
            by_size[size] = column
        times[:, j] = by_size[size]
    return times


def family_bound(lengths, cost) -> float:
    """The MILP's LP relaxation, cheaply: no plan of the family beats max(sum over long documents of their
    fewest rank-seconds on any aligned power-of-two group, plus the filler, over D; the longest document's
    fastest group). Not a bound on all plans: other group sizes can do better (bounds.py allows them)."""
    D = cost.cluster.domain_size
    long, filler = split_long(lengths, cost)
    F = filler_rank_seconds(filler, cost)
    if not long.size:
        return F / D
    overhead = cost.cluster.microbatch_overhead_s
    rank_seconds = np.full(long.size, math.inf)
    fastest = np.full(long.size, math.inf)
    for size in candidate_sizes(cost.cluster):
        seconds = cost.doc_alone_seconds(long, size)[3] + overhead
        rank_seconds = np.minimum(rank_seconds, size * seconds)
        fastest = np.minimum(fastest, seconds)
    return max((float(rank_seconds.sum()) + F) / D, float(fastest.max()))


def solve_family(lengths, cost, *, time_limit_s: float = 20.0) -> MilpResult:
    """Solve the MILP of the module docstring for one batch's lengths (ValueError: bad input, no highspy)."""
    if not time_limit_s > 0:
        raise ValueError(f"time_limit_s must be positive, got {time_limit_s!r}")
    try:
        import highspy
    except ImportError as err:
        raise ValueError("the MILP reference needs highspy (pip install highspy, or the package's 'test' extra)") from err
    D = cost.cluster.domain_size
    groups = aligned_groups(cost)
    long, filler = split_long(lengths, cost)
    times = group_times(long, groups, cost)
    if long.size and not np.isfinite(times).any(axis=1).all():
        raise ValueError("a document fits no aligned group even with the strongest allowed recompute")
    F = filler_rank_seconds(filler, cost)
    pairs = [(i, j) for i in range(long.size) for j in range(len(groups)) if np.isfinite(times[i, j])]
    n_x, inf = len(pairs), highspy.kHighsInf
    # columns: x (binaries), f_r (D), T
    n_cols = n_x + D + 1
    col_cost = np.zeros(n_cols)
    col_cost[-1] = 1.0
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("mip_rel_gap", 1e-6)
    h.addCols(n_cols, col_cost, np.zeros(n_cols), np.r_[np.ones(n_x), np.full(D + 1, inf)], 0,
              np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int32), np.zeros(0))
    if n_x:
        h.changeColsIntegrality(n_x, np.arange(n_x, dtype=np.int32),
                                np.full(n_x, highspy.HighsVarType.kInteger))
    rows: list[tuple[float, float, list[int], list[float]]] = []
    for i in range(long.size):                                   # each long document in one group
        cols = [k for k, (ii, _) in enumerate(pairs) if ii == i]
        rows.append((1.0, 1.0, cols, [1.0] * len(cols)))
    rows.append((F, F, list(range(n_x, n_x + D)), [1.0] * D))    # the filler is all placed
    for r in range(D):                                           # rank loads <= T
        cols, vals = [], []
        for k, (i, j) in enumerate(pairs):
            size, first = groups[j]
            if first <= r < first + size:
                cols.append(k)
                vals.append(float(times[i, j]))
        rows.append((-inf, 0.0, cols + [n_x + r, n_cols - 1], vals + [1.0, -1.0]))
    starts, indices, values = [], [], []
    for _, _, cols, vals in rows:
        starts.append(len(indices))
        indices += cols
        values += vals
    h.addRows(len(rows), np.array([r[0] for r in rows]), np.array([r[1] for r in rows]), len(indices),
              np.array(starts, dtype=np.int32), np.array(indices, dtype=np.int32), np.array(values))
    h.run()
    info = h.getInfo()
    status = h.getModelStatus()
    optimal = status == highspy.HighsModelStatus.kOptimal
    value = float(info.objective_function_value)
    dual = float(info.mip_dual_bound) if n_x else value     # an LP when there is no long document
    return MilpResult(value_s=value, dual_bound_s=dual, optimal=optimal, num_long=int(long.size),
                      num_groups=len(groups), solve_s=float(h.getRunTime()))
