"""The zig-zag padding rule, the one place it is written: the planner's estimates and the runtime's shards use it.

A sequence on a CP group of c ranks is cut into 2c equal chunks (rank i takes chunks i and 2c-1-i, which balances
causal attention), so it is padded to a multiple of 2c and every rank holds padded / c of its tokens. Plain
integer arithmetic: works on ints and elementwise on numpy integer arrays alike.
"""
from __future__ import annotations


def padded_length(length, cp_size: int, pad_multiple: int = 1):
    """`length` rounded up to a multiple of 2 · cp_size · pad_multiple (pad_multiple > 1: sequence parallelism
    also splits each rank's rows evenly over the TP group)."""
    unit = 2 * cp_size * pad_multiple
    return -(-length // unit) * unit


def local_tokens(length, cp_size: int):
    """Tokens per rank of a sequence on a CP group of `cp_size`: its padded length / c, i.e. 2·ceil(L / 2c)."""
    return padded_length(length, cp_size) // cp_size
