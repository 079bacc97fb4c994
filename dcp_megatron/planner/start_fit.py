"""The start check's question, and the values that would answer it yes: does a `max_seq_len` document fit a CP
group of the domain (the model's static state fits the budget, and the document fits some allowed group with some
allowed relief)? When not, the smallest memory per rank, largest CP size or domain size with which it would (the
same check, bisected: a refusal names the value that works, not only the flag)."""
from __future__ import annotations

import math

import numpy as np

from dcp_megatron.planner.layout import candidate_sizes, check_static_memory, min_fitting_size

MOST_BYTES = 1 << 60          # no budget beyond this is searched (an exabyte per rank)
MOST_DOMAIN_FACTOR = 1024     # nor a domain over 1024x the given one


def longest_fits(cost, max_seq_len: int) -> bool:
    """Whether a `max_seq_len` document fits the domain at this cost model's budget (the start check)."""
    try:
        check_static_memory(cost)
        min_fitting_size(np.array([max_seq_len]), np.array([0]), candidate_sizes(cost.cluster), cost)
    except ValueError:
        return False
    return True


def _fits_with(cost, max_seq_len: int, **changes) -> bool:
    try:
        changed = cost.with_cluster(**changes)
    except ValueError:        # e.g. a domain the EP size does not divide
        return False
    return longest_fits(changed, max_seq_len)


def _smallest(fits, lo: int, hi: int) -> int | None:
    """The smallest n in (lo, hi] with fits(n), fits taken as monotone (False at lo); None if not fits(hi)."""
    if not fits(hi):
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def smallest_memory_bytes(cost, max_seq_len: int) -> int | None:
    """The least memory per rank (ClusterSpec.mem_bytes_per_gpu, before the safety margin) at which the start check
    passes; None when no budget would do (the document fits no allowed group however much memory)."""
    now = cost.cluster.mem_bytes_per_gpu
    if longest_fits(cost, max_seq_len):
        return now
    hi = now
    while hi < MOST_BYTES and not _fits_with(cost, max_seq_len, mem_bytes_per_gpu=hi):
        hi *= 2
    return _smallest(lambda b: _fits_with(cost, max_seq_len, mem_bytes_per_gpu=b), now, min(hi, MOST_BYTES))


def budget_gb_that_fits(cost, max_seq_len: int) -> float | None:
    """`smallest_memory_bytes` in GiB, rounded up to 4 significant digits (what --dcp-memory-budget-gb takes:
    int(value x 2^30) bytes, so the printed value passes)."""
    need = smallest_memory_bytes(cost, max_seq_len)
    if need is None:
        return None
    gib = need / 2 ** 30
    step = 10.0 ** (math.floor(math.log10(gib)) - 3)
    value = math.ceil(gib / step) * step
    while int(float(f"{value:.4g}") * 2 ** 30) < need:     # the printed value, floored to bytes, must hold it
        value += step
    return float(f"{value:.4g}")


def smallest_max_cp_size(cost, max_seq_len: int) -> int | None:
    """The least largest CP group (ClusterSpec.max_cp_size) up to the domain with which the start check passes at
    this budget; None when not even the whole domain would do."""
    domain = cost.cluster.domain_size
    return _smallest(lambda c: _fits_with(cost, max_seq_len, max_cp_size=c), 0, domain)


def smallest_domain_size(cost, max_seq_len: int) -> int | None:
    """The least DCP domain (ranks in DP x CP) with which the start check passes at this budget and this
    --dcp-max-cp-size; None when none up to MOST_DOMAIN_FACTOR x the given one would do."""
    now, step = cost.cluster.domain_size, cost.model.ep      # the EP size must divide the domain
    if longest_fits(cost, max_seq_len):
        return now
    fits = lambda units: _fits_with(cost, max_seq_len, domain_size=units * step)
    lo = hi = now // step
    while hi * step < now * MOST_DOMAIN_FACTOR and not fits(hi):
        lo, hi = hi, 2 * hi
    found = _smallest(fits, lo, hi)
    return None if found is None else found * step
