"""GlobalBatcher: order kept, budget respected, every token exactly once, explicit overlong modes."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_megatron.planner.batcher import GlobalBatch, GlobalBatcher


def _documents(lengths, first_id=100):
    # Document ids deliberately differ from stream positions.
    return [(first_id + 7 * i, length) for i, length in enumerate(lengths)]


def _covered_tokens(batches):
    """document_id -> sorted list of (offset, length) pieces over all batches."""
    pieces = {}
    for batch in batches:
        for (_, seq_len), (doc_id, offset, length) in zip(batch.sequences, batch.sources):
            assert seq_len == length
            pieces.setdefault(doc_id, []).append((offset, length))
    return pieces


def test_cuts_in_order_and_emits_the_last_partial_batch():
    batcher = GlobalBatcher(tokens_per_step=10, max_seq_len=10)
    batches = list(batcher.batches(_documents([4, 5, 2, 8, 10, 1])))
    assert [b.step for b in batches] == [0, 1, 2, 3]
    assert [[n for _, n in b.sequences] for b in batches] == [[4, 5], [2, 8], [10], [1]]
    assert [[s for s, _ in b.sequences] for b in batches] == [[0, 1], [2, 3], [4], [5]]
    assert batches[1].sources == ((114, 0, 2), (121, 0, 8))
    assert batches[0].num_tokens == 9 and batches[2].max_length == 10


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=0, max_size=60),
       tokens_per_step=st.integers(1, 400), max_seq_len=st.integers(1, 400),
       overlong=st.sampled_from(["split", "truncate"]))
def test_properties_budget_order_and_coverage(lengths, tokens_per_step, max_seq_len, overlong):
    max_seq_len = min(max_seq_len, tokens_per_step)
    docs = _documents(lengths)
    batches = list(GlobalBatcher(tokens_per_step=tokens_per_step, max_seq_len=max_seq_len,
                                 overlong=overlong).batches(docs))
    flat_sources = [src for b in batches for src in b.sources]
    flat_ids = [sid for b in batches for sid, _ in b.sequences]
    assert flat_ids == list(range(len(flat_ids)))                      # running counter
    assert [src[0] for src in flat_sources] == sorted(src[0] for src in flat_sources)  # stream order
    for b in batches:
        assert 0 < b.num_tokens <= tokens_per_step
        assert b.max_length <= max_seq_len
    # A batch is closed only when the next sequence would not fit.
    for b, nxt in zip(batches, batches[1:]):
        assert b.num_tokens + nxt.sequences[0][1] > tokens_per_step
    pieces = _covered_tokens(batches)
    for doc_id, length in docs:
        got = pieces.pop(doc_id)
        if overlong == "split" or length <= max_seq_len:
            # every token exactly once, pieces contiguous from offset 0
            cursor = 0
            for offset, piece_len in got:
                assert offset == cursor
                cursor += piece_len
            assert cursor == length
        else:
            assert got == [(0, max_seq_len)]
    assert not pieces


def test_split_pieces_have_max_seq_len_tokens_except_the_last():
    batches = list(GlobalBatcher(tokens_per_step=16, max_seq_len=5, overlong="split").batches([(9, 12), (3, 2)]))
    assert [src for b in batches for src in b.sources] == [(9, 0, 5), (9, 5, 5), (9, 10, 2), (3, 0, 2)]
    assert [n for b in batches for _, n in b.sequences] == [5, 5, 2, 2]


def test_truncate_keeps_the_head_of_the_document():
    batches = list(GlobalBatcher(tokens_per_step=16, max_seq_len=5, overlong="truncate").batches([(9, 12)]))
    assert batches == [GlobalBatch(0, ((0, 5),), ((9, 0, 5),))]


def test_overlong_is_an_error_by_default_naming_document_and_opt_ins():
    batcher = GlobalBatcher(tokens_per_step=100, max_seq_len=50)
    with pytest.raises(ValueError) as err:
        list(batcher.batches([(1, 10), (42, 51)]))
    message = str(err.value)
    assert "document 42" in message and "51" in message and "max_seq_len=50" in message
    assert "split" in message and "truncate" in message


def test_accepts_numpy_lengths_and_rejects_bad_ones():
    batches = list(GlobalBatcher(tokens_per_step=10, max_seq_len=10).batches(
        zip(range(3), np.array([3, 4, 5], dtype=np.int64))))
    assert [n for b in batches for _, n in b.sequences] == [3, 4, 5]
    assert all(type(n) is int for b in batches for _, n in b.sequences)
    for bad in (0, -3, 2.5, "7"):
        with pytest.raises(ValueError, match="document 5 has length"):
            list(GlobalBatcher(tokens_per_step=10, max_seq_len=10).batches([(5, bad)]))


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(tokens_per_step=0, max_seq_len=1), "tokens_per_step"),
    (dict(tokens_per_step=10, max_seq_len=0), "max_seq_len"),
    (dict(tokens_per_step=10, max_seq_len=11), "max_seq_len=11 exceeds tokens_per_step=10"),
    (dict(tokens_per_step=10, max_seq_len=5, overlong="drop"), "'drop'"),
])
def test_bad_configuration_is_a_clear_error(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        GlobalBatcher(**kwargs)


def test_is_lazy_on_an_endless_stream():
    import itertools
    endless = ((i, 1 + i % 5) for i in itertools.count())
    first = list(itertools.islice(GlobalBatcher(tokens_per_step=20, max_seq_len=5).batches(endless), 3))
    assert [b.step for b in first] == [0, 1, 2]
