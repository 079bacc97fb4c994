"""Document sources: MockDocuments is deterministic and long-tailed; the protocol's range checks."""
import numpy as np
import pytest

from dcp_megatron.data.documents import DocumentSource, InMemoryDocuments, MockDocuments


def test_mock_documents_are_deterministic_and_seed_dependent():
    a = MockDocuments(seed=3, num_documents=500, max_len=2048, vocab_size=512)
    b = MockDocuments(seed=3, num_documents=500, max_len=2048, vocab_size=512)
    c = MockDocuments(seed=4, num_documents=500, max_len=2048, vocab_size=512)
    assert np.array_equal(a.lengths(), b.lengths())
    assert not np.array_equal(a.lengths(), c.lengths())
    for doc_id in (0, 17, 499):
        assert np.array_equal(a.tokens(doc_id), b.tokens(doc_id))
    assert not np.array_equal(a.tokens(0)[:50], c.tokens(0)[:50])


def test_mock_lengths_are_long_tailed_within_the_cap_and_tokens_in_vocab():
    docs = MockDocuments(seed=0, num_documents=3000, max_len=4096, vocab_size=300)
    counts = docs.lengths()
    planned = counts - 1
    assert planned.min() >= 1 and planned.max() <= 4096
    # Long tail: the longest documents are many times the median, but the cap is not a spike.
    assert planned.max() > 8 * np.median(planned)
    assert np.count_nonzero(planned == 4096) < 0.01 * planned.size
    for doc_id in range(0, 3000, 300):
        toks = docs.tokens(doc_id)
        assert toks.dtype == np.int64 and toks.size == docs.length(doc_id) == counts[doc_id]
        assert toks.min() >= 0 and toks.max() < 300


def test_mock_is_prefix_stable_and_token_ranges_are_slices():
    small = MockDocuments(seed=5, num_documents=100, max_len=1000, vocab_size=64)
    large = MockDocuments(seed=5, num_documents=400, max_len=1000, vocab_size=64)
    assert np.array_equal(small.lengths(), large.lengths()[:100])
    doc = large.tokens(7)
    assert np.array_equal(large.tokens(7, 3, 9), doc[3:9])
    assert np.array_equal(large.tokens(7, 2), doc[2:])
    assert large.tokens(7, 4, 4).size == 0


def test_sources_implement_the_protocol():
    assert isinstance(MockDocuments(seed=0, num_documents=2, max_len=8, vocab_size=8), DocumentSource)
    assert isinstance(InMemoryDocuments([[1, 2, 3]]), DocumentSource)


@pytest.mark.parametrize("kwargs, words", [
    (dict(seed=-1), "seed"), (dict(num_documents=0), "num_documents"), (dict(max_len=0), "max_len"),
    (dict(vocab_size=1), "vocab_size"), (dict(distribution="zipf"), "zipf"), (dict(max_len=2.5), "max_len"),
])
def test_mock_rejects_bad_settings(kwargs, words):
    base = dict(seed=0, num_documents=4, max_len=64, vocab_size=16)
    with pytest.raises(ValueError, match=words):
        MockDocuments(**{**base, **kwargs})


def test_out_of_range_reads_name_the_document():
    docs = InMemoryDocuments([np.arange(5), np.arange(3)])
    with pytest.raises(ValueError, match="document id 2"):
        docs.tokens(2)
    with pytest.raises(ValueError, match="document 1 of 3 tokens"):
        docs.tokens(1, 1, 4)
    with pytest.raises(ValueError, match="document id -1"):
        docs.length(-1)
    with pytest.raises(ValueError, match="1-D"):
        InMemoryDocuments([np.zeros((2, 2))])
