"""Documents kept whole: sources of token documents and the preprocessing that writes them
(tools/preprocess_data.py, tools/make_demo_data.py, the demo's corpus statistics).

documents.py          DocumentSource protocol, MockDocuments, InMemoryDocuments (numpy only)
indexed_documents.py  megatron-core .bin/.idx files as a DocumentSource
preprocess.py         text -> token ids -> megatron-core .bin/.idx (reader: indexed_documents.py)
"""
