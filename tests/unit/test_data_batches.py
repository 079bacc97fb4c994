"""GlobalBatchStream: seeded order, every training position once per epoch, exact resume."""
import copy
import inspect
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_megatron.data.documents import InMemoryDocuments, MockDocuments
from dcp_megatron.planner.batcher import GlobalBatcher
from tests.support.batch_stream import GlobalBatchStream, epoch_order


def _docs_of_lengths(planned_lengths):
    """Documents with planned lengths as given (tokens = planned + 1)."""
    return InMemoryDocuments([np.arange(n + 1) for n in planned_lengths])


def _epoch_batches(stream):
    """The remaining batches of the stream's current epoch."""
    epoch = stream.position.epoch
    batches = []
    while stream.position.epoch == epoch:
        batches.append(next(stream))
    return batches


def test_order_is_a_seeded_permutation_per_epoch():
    first = epoch_order(1000, 7, 0)
    assert sorted(first.tolist()) == list(range(1000))
    assert np.array_equal(first, epoch_order(1000, 7, 0))
    assert not np.array_equal(first, epoch_order(1000, 7, 1))
    assert not np.array_equal(first, epoch_order(1000, 8, 0))
    assert np.array_equal(epoch_order(5, 7, 3, shuffle=False), np.arange(5))


def test_batches_are_the_batcher_over_the_seeded_order_and_nothing_else(monkeypatch):
    docs = MockDocuments(seed=1, num_documents=300, max_len=1024, vocab_size=64)
    planned = docs.lengths() - 1
    reference = list(GlobalBatcher(tokens_per_step=4096, max_seq_len=1024).batches(
        (int(d), int(planned[d])) for d in epoch_order(300, 11, 0)))
    # The stream takes no layout argument, and the environment of a distributed launch does not matter.
    params = set(inspect.signature(GlobalBatchStream).parameters)
    assert params == {"source", "tokens_per_step", "max_seq_len", "seed", "overlong", "shuffle"}
    for env in ({}, {"WORLD_SIZE": "8", "RANK": "5", "LOCAL_RANK": "5"}):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        stream = GlobalBatchStream(docs, tokens_per_step=4096, max_seq_len=1024, seed=11)
        assert _epoch_batches(stream) == reference
    other_seed = GlobalBatchStream(docs, tokens_per_step=4096, max_seq_len=1024, seed=12)
    assert next(other_seed).sources != reference[0].sources


def _check_epoch_coverage(batches, planned, max_seq_len, overlong, tokens_per_step):
    covered = {d: np.zeros(n, dtype=np.int64) for d, n in enumerate(planned)}
    for batch in batches:
        assert batch.num_tokens <= tokens_per_step
        for (_, length), (doc_id, offset, piece_length) in zip(batch.sequences, batch.sources):
            assert length == piece_length and 1 <= length <= max_seq_len
            covered[doc_id][offset:offset + length] += 1
    for doc_id, counts in covered.items():
        expected_end = min(planned[doc_id], max_seq_len) if overlong == "truncate" else planned[doc_id]
        assert np.all(counts[:expected_end] == 1), (doc_id, counts)
        assert np.all(counts[expected_end:] == 0)


@settings(max_examples=60, deadline=None)
@given(planned=st.lists(st.integers(1, 90), min_size=1, max_size=40), max_seq_len=st.integers(1, 40),
       extra_budget=st.integers(0, 100), overlong=st.sampled_from(["split", "truncate"]), seed=st.integers(0, 5))
def test_every_training_position_once_per_epoch(planned, max_seq_len, extra_budget, overlong, seed):
    tokens_per_step = max_seq_len + extra_budget
    stream = GlobalBatchStream(_docs_of_lengths(planned), tokens_per_step=tokens_per_step,
                               max_seq_len=max_seq_len, seed=seed, overlong=overlong)
    seen_seq_ids = set()
    for epoch in range(2):
        batches = _epoch_batches(stream)
        _check_epoch_coverage(batches, planned, max_seq_len, overlong, tokens_per_step)
        for batch in batches:
            ids = [s for s, _ in batch.sequences]
            assert not seen_seq_ids & set(ids)
            seen_seq_ids.update(ids)
    assert stream.position.epoch == 2 and stream.position.offset == 0


def test_steps_count_across_epochs_and_error_mode_covers_whole_documents():
    planned = [5, 9, 3, 7, 1, 8]
    stream = GlobalBatchStream(_docs_of_lengths(planned), tokens_per_step=12, max_seq_len=9, seed=2)
    epoch0, epoch1 = _epoch_batches(stream), _epoch_batches(stream)
    steps = [b.step for b in epoch0 + epoch1]
    assert steps == list(range(len(steps)))
    _check_epoch_coverage(epoch1, planned, 9, "error", 12)
    visited = [[doc_id for b in batches for doc_id, _, _ in b.sources] for batches in (epoch0, epoch1)]
    assert visited == [epoch_order(6, 2, 0).tolist(), epoch_order(6, 2, 1).tolist()]
    assert visited[0] != visited[1]


@pytest.mark.parametrize("overlong, max_seq_len", [("split", 64), ("truncate", 64), ("error", 2048)])
def test_resume_at_step_k_gives_identical_batches(overlong, max_seq_len):
    docs = MockDocuments(seed=9, num_documents=120, max_len=2048, vocab_size=32)
    settings_ = dict(tokens_per_step=2048, max_seq_len=max_seq_len, seed=4, overlong=overlong)
    uninterrupted = GlobalBatchStream(docs, **settings_)
    reference = [next(uninterrupted) for _ in range(80)]   # several epochs at the small budgets
    assert uninterrupted.position.epoch >= 1
    straddled = 0
    for k in (0, 1, 5, 17, 33, 50, 79):
        stream = GlobalBatchStream(docs, **settings_)
        for _ in range(k):
            next(stream)
        state = json.loads(json.dumps(stream.state_dict()))   # what a checkpoint stores
        straddled += stream.position.token_offset > 0
        resumed = GlobalBatchStream(docs, **settings_)
        resumed.load_state_dict(copy.deepcopy(state))
        assert resumed.position == stream.position
        assert [next(resumed) for _ in range(80 - k)] == reference[k:]
    if overlong == "split":
        assert straddled > 0, "no resume point fell inside a split document; the test lost its hard case"


def test_resume_rejects_changed_data_or_settings():
    docs = MockDocuments(seed=9, num_documents=50, max_len=512, vocab_size=32)
    stream = GlobalBatchStream(docs, tokens_per_step=1024, max_seq_len=512, seed=4)
    next(stream)
    state = stream.state_dict()
    for changed, words in [(dict(seed=5), "seed: saved 4, now 5"), (dict(tokens_per_step=2048), "tokens_per_step")]:
        other = GlobalBatchStream(docs, **{**dict(tokens_per_step=1024, max_seq_len=512, seed=4), **changed})
        with pytest.raises(ValueError, match=words):
            other.load_state_dict(state)
    more_docs = MockDocuments(seed=9, num_documents=51, max_len=512, vocab_size=32)
    with pytest.raises(ValueError, match="num_documents"):
        GlobalBatchStream(more_docs, tokens_per_step=1024, max_seq_len=512, seed=4).load_state_dict(state)
    bad = copy.deepcopy(state)
    bad["position"]["offset"] = 50
    with pytest.raises(ValueError, match="out of range"):
        GlobalBatchStream(docs, tokens_per_step=1024, max_seq_len=512, seed=4).load_state_dict(bad)
    with pytest.raises(ValueError, match="expected keys"):
        stream.load_state_dict({"epoch": 0})


def test_bad_corpora_are_rejected_up_front():
    with pytest.raises(ValueError, match="document 1 with 1 tokens|e.g. document 1 with 1"):
        GlobalBatchStream(InMemoryDocuments([[1, 2], [3], [4, 5]]), tokens_per_step=8, max_seq_len=4, seed=0)
    with pytest.raises(ValueError, match=r"document 2 with 9.*overlong='split'"):
        GlobalBatchStream(_docs_of_lengths([3, 4, 9]), tokens_per_step=8, max_seq_len=8, seed=0)
    with pytest.raises(ValueError, match="no documents"):
        GlobalBatchStream(InMemoryDocuments([]), tokens_per_step=8, max_seq_len=8, seed=0)
    with pytest.raises(ValueError, match="seed"):
        GlobalBatchStream(_docs_of_lengths([3]), tokens_per_step=8, max_seq_len=8, seed=-2)
