"""Zig-zag sharding: every token exactly once, positions kept, chunk order, padding masked."""
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_megatron.planner.padding import padded_length
from dcp_megatron.runtime.sharding import shard_microbatch


def _expected_rows(lengths, cp_size, cp_rank):
    """Independent oracle: (doc, position) of every local row, built chunk by chunk."""
    rows = []
    for doc, length in enumerate(lengths):
        chunk = -(-length // (2 * cp_size))
        for index in (cp_rank, 2 * cp_size - 1 - cp_rank):
            rows += [(doc, p) for p in range(index * chunk, (index + 1) * chunk)]
    return rows


def _check(lengths, cp_size):
    offsets = [sum(lengths[:i]) for i in range(len(lengths))]
    seen = []
    shards = [shard_microbatch(lengths, cp_size, r) for r in range(cp_size)]
    for rank, shard in enumerate(shards):
        rows = _expected_rows(lengths, cp_size, rank)
        assert shard.doc_ids.tolist() == [d for d, _ in rows]
        assert shard.position_ids.tolist() == [p for _, p in rows]
        valid = [p < lengths[d] for d, p in rows]
        assert shard.valid_mask.tolist() == valid
        assert shard.token_index.tolist() == [offsets[d] + p if ok else -1 for (d, p), ok in zip(rows, valid)]
        assert shard.cu_seqlens.dtype == torch.int32
        assert shard.cu_seqlens.tolist() == [0] + list(itertools.accumulate(n // cp_size for n in shard.padded_lengths))
        assert torch.equal(shard.cu_seqlens, shards[0].cu_seqlens)  # same local layout on every rank
        assert shard.num_local_tokens == sum(shard.padded_lengths) // cp_size
        seen += [i for i in shard.token_index.tolist() if i >= 0]
    assert sorted(seen) == list(range(sum(lengths)))  # union covers every token exactly once
    for length, padded in zip(lengths, shards[0].padded_lengths):
        assert padded % (2 * cp_size) == 0 and length <= padded < length + 2 * cp_size


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4, 5])
def test_all_small_layouts(cp_size):
    for num_docs in (1, 2):
        for lengths in itertools.product(range(1, 2 * cp_size + 4), repeat=num_docs):
            _check(list(lengths), cp_size)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=12), cp_size=st.integers(1, 8))
def test_random_layouts(lengths, cp_size):
    _check(lengths, cp_size)


def test_documents_shorter_than_2c_leave_ranks_with_only_padding():
    shards = [shard_microbatch([1, 3], 4, r) for r in range(4)]
    assert [s.num_valid_tokens for s in shards] == [2, 1, 1, 0]  # chunks 0 | 1 | 2 hold one token each
    assert all(s.num_local_tokens == 4 for s in shards)
    assert shards[3].token_index.tolist() == [-1, -1, -1, -1]


def test_zigzag_balances_causal_work():
    # With no padding, sum over local rows of (position + 1) is the rank's causal attention work.
    for cp_size in (2, 3, 4, 8):
        length = 2 * cp_size * 7
        work = {int((shard_microbatch([length], cp_size, r).position_ids + 1).sum()) for r in range(cp_size)}
        assert len(work) == 1, (cp_size, work)


def test_take_selects_rows_fills_padding_and_passes_gradients():
    lengths = [3, 6]
    shard = shard_microbatch(lengths, 2, 1)
    x = torch.arange(9.0).repeat(2, 1).T.contiguous().requires_grad_()  # [9, 2]
    local = shard.take(x, fill=-5.0)
    expected = [[float(i)] * 2 if i >= 0 else [-5.0] * 2 for i in shard.token_index.tolist()]
    assert local.tolist() == expected
    local.sum().backward()
    counts = torch.zeros(9)
    counts[shard.token_index[shard.valid_mask]] = 1
    assert torch.equal(x.grad[:, 0], counts)
    with pytest.raises(ValueError, match="expects 9 rows"):
        shard.take(torch.zeros(8))


def test_for_rank_and_empty_microbatch():
    shard = shard_microbatch([7, 2], 3, 0)
    assert shard.for_rank(2).position_ids.tolist() == shard_microbatch([7, 2], 3, 2).position_ids.tolist()
    empty = shard_microbatch([], 2, 1)
    assert empty.num_local_tokens == 0 and empty.cu_seqlens.tolist() == [0]
    assert padded_length(7, 3) == 12 and padded_length(6, 3) == 6


@pytest.mark.parametrize("args, message", [
    (([4], 0, 0), "cp_size"),
    (([4], 2, 2), r"cp_rank must be in \[0, 2\)"),
    (([4, 0, 3], 2, 0), r"\(1, 0\)"),
])
def test_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        shard_microbatch(*args)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 200), min_size=1, max_size=8), cp_size=st.integers(1, 4),
       pad_multiple=st.integers(1, 4))
def test_pad_multiple_splits_rows_evenly_and_still_covers_every_token_once(lengths, cp_size, pad_multiple):
    """Sequence parallelism splits a micro-batch's local rows over TP: they must divide evenly."""
    shards = [shard_microbatch(lengths, cp_size, r, pad_multiple=pad_multiple) for r in range(cp_size)]
    unit = 2 * cp_size * pad_multiple
    seen = []
    for rank, shard in enumerate(shards):
        assert shard.num_local_tokens % pad_multiple == 0
        assert all(length <= padded < length + unit and padded % unit == 0
                   for length, padded in zip(lengths, shard.padded_lengths))
        assert shard.for_rank(rank).token_index.tolist() == shard.token_index.tolist()
        # real tokens keep their positions; padding only ever follows a document's last real token
        for doc in range(len(lengths)):
            rows = shard.doc_ids == doc
            assert bool((shard.position_ids[rows][shard.valid_mask[rows]] < lengths[doc]).all())
        seen += [i for i in shard.token_index.tolist() if i >= 0]
    assert sorted(seen) == list(range(sum(lengths)))
    with pytest.raises(ValueError, match="pad_multiple"):
        shard_microbatch(lengths, cp_size, 0, pad_multiple=0)
