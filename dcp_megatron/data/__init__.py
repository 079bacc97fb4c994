"""Data pipeline that keeps documents whole.

documents.py  DocumentSource protocol, MockDocuments, InMemoryDocuments (numpy only)
batches.py    GlobalBatchStream: seeded order per epoch -> token-budget global batches, resumable
assembly.py   tokens/labels of one plan micro-batch (torch enters here)
preprocess.py text -> token ids -> megatron-core .bin/.idx (reader: dcp_megatron/data/indexed_documents.py)
"""
