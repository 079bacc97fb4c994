"""The run's documents and its global batch stream, from --data-path or --mock-data.

Both go through `GlobalBatchStream`, whose batches depend only on the corpus, the seed and the
token budget (never on the layout), and whose `state_dict()` the checkpoint stores.
"""
from __future__ import annotations

import argparse

from dcp_megatron.data.batches import GlobalBatchStream
from dcp_megatron.data.documents import DocumentSource, MockDocuments

# Mock corpus size: documents are drawn lazily by id, so this only bounds an epoch.
MOCK_NUM_DOCUMENTS = 100_000


def open_documents(args: argparse.Namespace) -> DocumentSource:
    if args.data_path is not None:
        from dcp_megatron.megatron.indexed_documents import IndexedDocuments
        return IndexedDocuments(args.data_path, vocab_size=args.vocab_size)
    return MockDocuments(seed=args.seed, num_documents=MOCK_NUM_DOCUMENTS, max_len=args.seq_length,
                         vocab_size=args.vocab_size)


def batch_stream(args: argparse.Namespace, source: DocumentSource) -> GlobalBatchStream:
    return GlobalBatchStream(source, tokens_per_step=args.tokens_per_step, max_seq_len=args.seq_length,
                             seed=args.seed, overlong=args.overlong)
