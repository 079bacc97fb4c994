"""Micro-batch assembly: inputs/labels per piece, micro-batch order, reads only its documents."""
import numpy as np
import pytest
import torch

from dcp_megatron.data.documents import InMemoryDocuments
from dcp_megatron.planner.plan import MicroBatch, Recompute
from tests.support.batch_stream import GlobalBatchStream
from tests.support.microbatch_assembly import assemble_microbatch, microbatch_arrays


class ReadLog(InMemoryDocuments):
    """Records every token read, to check which documents a rank touches."""

    def __init__(self, documents):
        super().__init__(documents)
        self.reads = []

    def tokens(self, doc_id, start=0, stop=None):
        self.reads.append(int(doc_id))
        return super().tokens(doc_id, start, stop)


def _corpus(seed=0, num_documents=40):
    rng = np.random.default_rng(seed)
    # Token ids encode (document, position) so that any misplaced token is visible.
    return [1000 * d + np.arange(int(n)) for d, n in enumerate(rng.integers(2, 60, size=num_documents))]


def test_tokens_and_labels_follow_each_piece_in_microbatch_order():
    corpus = _corpus()
    docs = ReadLog(corpus)
    stream = GlobalBatchStream(docs, tokens_per_step=120, max_seq_len=25, seed=3, overlong="split")
    checked_split_piece = False
    for _ in range(6):
        batch = next(stream)
        rng = np.random.default_rng(batch.step)
        picked = rng.permutation(len(batch.sequences))[: max(1, len(batch.sequences) // 2)]
        chosen = [batch.sequences[i] for i in picked]
        docs.reads.clear()
        out = assemble_microbatch(docs, batch, MicroBatch(sequences=tuple(chosen), recompute=Recompute("selective")))
        assert out.tokens.dtype == torch.int64 and out.labels.dtype == torch.int64
        assert out.tokens.shape == out.labels.shape == (sum(n for _, n in chosen),)
        sources = dict(zip((s for s, _ in batch.sequences), batch.sources))
        expected_inputs, expected_labels = [], []
        for seq_id, length in chosen:
            doc_id, offset, _ = sources[seq_id]
            expected_inputs.append(corpus[doc_id][offset:offset + length])
            expected_labels.append(corpus[doc_id][offset + 1:offset + length + 1])
            checked_split_piece |= offset > 0
        assert torch.equal(out.tokens, torch.from_numpy(np.concatenate(expected_inputs)))
        assert torch.equal(out.labels, torch.from_numpy(np.concatenate(expected_labels)))
        # A label is always the next token of the same document.
        assert torch.equal(out.labels // 1000, out.tokens // 1000)
        assert torch.equal(out.labels % 1000, out.tokens % 1000 + 1)
        assert sorted(docs.reads) == sorted(sources[s][0] for s, _ in chosen)
    assert checked_split_piece


def test_plain_sequence_lists_and_empty_microbatches():
    docs = InMemoryDocuments(_corpus(1, 10))
    batch = next(GlobalBatchStream(docs, tokens_per_step=400, max_seq_len=100, seed=0))
    inputs, labels = microbatch_arrays(docs, batch, list(batch.sequences[:2]))
    out = assemble_microbatch(docs, batch, list(batch.sequences[:2]))
    assert np.array_equal(out.tokens.numpy(), inputs) and np.array_equal(out.labels.numpy(), labels)
    empty = assemble_microbatch(docs, batch, [])
    assert empty.tokens.shape == (0,) and empty.labels.dtype == torch.int64


def test_sequences_not_in_the_batch_are_rejected():
    docs = InMemoryDocuments(_corpus(2, 10))
    batch = next(GlobalBatchStream(docs, tokens_per_step=400, max_seq_len=100, seed=0))
    seq_id, length = batch.sequences[0]
    with pytest.raises(ValueError, match=f"sequence 999 .* not in global batch step {batch.step}"):
        assemble_microbatch(docs, batch, [(999, 3)])
    with pytest.raises(ValueError, match=f"sequence {seq_id} has length {length + 1} in the micro-batch"):
        assemble_microbatch(docs, batch, [(seq_id, length + 1)])
