"""preprocess -> megatron-core .bin/.idx -> IndexedDocuments: round trip, clear errors on bad files."""
import importlib.util
import json
import os
import sysconfig

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from dcp_megatron.data.preprocess import (
    BYTE_EOD_ID,
    ByteTokenizer,
    HFTokenizer,
    iter_input_texts,
    preprocess_texts,
)
from dcp_megatron.data.indexed_documents import IndexedDataError, IndexedDocuments
from tests.support.batch_stream import GlobalBatchStream
from tests.support.microbatch_assembly import assemble_microbatch

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools")
TEXTS = ["hello world", "", "x", "naïve café — 東京 🚀\n" * 3, "def f():\n    return 1\n"]


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(TOOLS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def dataset(tmp_path):
    prefix = str(tmp_path / "corpus")
    stats = preprocess_texts(TEXTS, prefix, ByteTokenizer())
    return prefix, stats


def test_round_trip_tokens_equal_and_short_documents_dropped(dataset):
    prefix, stats = dataset
    kept = [t for t in TEXTS if t]   # "" is only the end-of-document id: 1 token, cannot train
    assert stats == {"documents": len(kept), "tokens": sum(len(t.encode()) + 1 for t in kept), "dropped": 1,
                     "vocab_size": 257}
    docs = IndexedDocuments(prefix, vocab_size=512)
    assert docs.num_documents == len(kept)
    for doc_id, text in enumerate(kept):
        expected = np.append(np.frombuffer(text.encode(), dtype=np.uint8), BYTE_EOD_ID)
        assert docs.length(doc_id) == expected.size == docs.lengths()[doc_id]
        assert np.array_equal(docs.tokens(doc_id), expected) and docs.tokens(doc_id).dtype == np.int64
        assert np.array_equal(docs.tokens(doc_id, 1, min(4, expected.size)), expected[1:4])
        assert ByteTokenizer.decode(docs.tokens(doc_id)) == text
    # The stream and the assembly run on it end to end.
    batch = next(GlobalBatchStream(docs, tokens_per_step=256, max_seq_len=128, seed=0))
    out = assemble_microbatch(docs, batch, batch.sequences)
    assert out.tokens.numel() == batch.num_tokens and int(out.labels.max()) == BYTE_EOD_ID


def test_documents_of_several_megatron_sequences_read_whole(tmp_path):
    prefix = str(tmp_path / "multi")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    parts = [[np.arange(3), np.arange(10, 15)], [np.arange(20, 22)], [np.arange(30, 31), np.arange(40, 43)]]
    for doc in parts:
        for part in doc:
            builder.add_item(torch.from_numpy(part))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    docs = IndexedDocuments(prefix)
    assert docs.lengths().tolist() == [8, 2, 4]
    for doc_id, doc in enumerate(parts):
        assert np.array_equal(docs.tokens(doc_id), np.concatenate(doc))


def test_reader_rejects_documents_that_cannot_train(tmp_path):
    prefix = str(tmp_path / "short")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    builder.add_document(np.arange(5), [5])
    builder.add_document(np.arange(1), [1])
    builder.finalize(prefix + ".idx")
    with pytest.raises(IndexedDataError, match="fewer than 2 tokens .*document 1: 1"):
        IndexedDocuments(prefix)


def _corrupt(prefix, which, edit):
    path = f"{prefix}.{which}"
    with open(path, "rb") as f:
        data = bytearray(f.read())
    with open(path, "wb") as f:
        f.write(edit(data))


@pytest.mark.parametrize("which, edit, words", [
    ("idx", lambda d: d[:-5], "truncated index"),
    ("idx", lambda d: d[:20], "truncated index header"),
    ("idx", lambda d: b"GARBAGE!!" + d[9:], "not a megatron-core index file"),
    ("idx", lambda d: d + b"\0" * 7, "7 unexpected bytes"),
    ("idx", lambda d: d[:9] + (2).to_bytes(8, "little") + d[17:], "unsupported index version 2"),
    ("idx", lambda d: d[:17] + bytes([6]) + d[18:], "dtype code 6 is not an integer"),
    ("bin", lambda d: d[:-2], "the .bin is truncated or the two files do not belong together"),
    ("bin", lambda d: d + d, "do not belong together"),
    ("bin", lambda d: b"", "empty data file"),
])
def test_corrupt_or_mismatched_files_name_the_file_and_the_problem(dataset, which, edit, words):
    prefix, _ = dataset
    _corrupt(prefix, which, edit)
    with pytest.raises(IndexedDataError, match=words) as info:
        IndexedDocuments(prefix)
    assert f"{prefix}" in str(info.value)


def test_corrupt_token_bytes_are_caught_when_read(dataset):
    prefix, _ = dataset
    _corrupt(prefix, "bin", lambda d: d[:4] + b"\xff\xff" + d[6:])   # third token of document 0
    docs = IndexedDocuments(prefix, vocab_size=512)
    assert docs.num_documents == 4 and np.array_equal(docs.tokens(1), [ord("x"), BYTE_EOD_ID])
    with pytest.raises(IndexedDataError, match=r"corpus.bin: document 0 holds token id 65535, outside .*\[0, 512\)"):
        docs.tokens(0)


def test_missing_files_and_wrong_prefix(dataset):
    prefix, _ = dataset
    with pytest.raises(IndexedDataError, match="without .bin/.idx"):
        IndexedDocuments(prefix + ".bin")
    os.remove(prefix + ".idx")
    with pytest.raises(IndexedDataError, match=r"corpus.idx: no such file"):
        IndexedDocuments(prefix)
    with pytest.raises(IndexedDataError, match=r"nowhere.idx: no such file"):
        IndexedDocuments(prefix + "-nowhere")


def test_input_formats(tmp_path):
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text(json.dumps({"text": "first", "id": 1}) + "\n\n" + json.dumps({"text": "second"}) + "\n")
    plain = tmp_path / "b.txt"
    plain.write_text("para one\nstill one\n\n  \npara two\n")
    whole_file = "para one\nstill one\n\n  \npara two\n"
    assert list(iter_input_texts([str(jsonl), str(plain)])) == ["first", "second", whole_file]
    assert list(iter_input_texts([str(plain)], split_on_blank_lines=True)) == ["para one\nstill one", "para two\n"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: no key 'text' .*\['body'\]"):
        list(iter_input_texts([str(bad)]))
    with pytest.raises(ValueError, match="cannot read input"):
        list(iter_input_texts([str(tmp_path / "missing.txt")]))


def test_preprocess_cli(tmp_path, capsys):
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"content": t}) + "\n" for t in TEXTS))
    prefix = str(tmp_path / "cli")
    tool = _tool("preprocess_data")
    assert tool.main(["--input", str(jsonl), "--json-key", "content", "--output-prefix", prefix]) == 0
    out = capsys.readouterr().out
    assert f"{len(TEXTS) - 1} documents" in out and "dropped 1 document" in out
    docs = IndexedDocuments(prefix)
    assert ByteTokenizer.decode(docs.tokens(0)) == TEXTS[0]
    assert tool.main(["--input", str(jsonl), "--output-prefix", str(tmp_path / "x")]) == 2
    assert "no key 'text'" in capsys.readouterr().err
    assert not os.path.exists(str(tmp_path / "x.bin")) and not os.path.exists(str(tmp_path / "x.bin.partial"))


def test_hf_tokenizer_missing_library_is_a_clear_error(tmp_path):
    if importlib.util.find_spec("tokenizers") is not None:
        pytest.skip("the tokenizers package is installed; covered by test_hf_tokenizer_round_trip")
    with pytest.raises(ValueError, match="needs the HF 'tokenizers' package"):
        HFTokenizer(str(tmp_path / "tokenizer.json"))


def test_hf_tokenizer_round_trip(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "</s>": 1, "hello": 2, "world": 3}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    model.save(str(tmp_path / "tokenizer.json"))
    tokenizer = HFTokenizer(str(tmp_path / "tokenizer.json"))
    assert tokenizer.eod_id == 1 and tokenizer.vocab_size == 4
    preprocess_texts(["hello world hello", "world"], str(tmp_path / "hf"), tokenizer)
    docs = IndexedDocuments(str(tmp_path / "hf"), vocab_size=4)
    assert docs.tokens(0).tolist() == [2, 3, 2, 1] and docs.tokens(1).tolist() == [3, 1]


def test_make_demo_data_builds_real_stdlib_text(tmp_path, capsys):
    tool = _tool("make_demo_data")
    stdlib = sysconfig.get_paths()["stdlib"]
    first = sorted(n for n in os.listdir(stdlib) if n.endswith(".py"))[:3]
    sources = [open(os.path.join(stdlib, n), encoding="utf-8", errors="replace").read() for n in first]
    for source in sources:
        assert "".join(tool.split_definitions(source)) == source   # cutting loses nothing
    prefix = str(tmp_path / "demo")
    assert tool.main(["--output-prefix", prefix, "--max-files", "3"]) == 0
    assert "documents" in capsys.readouterr().out
    docs = IndexedDocuments(prefix, vocab_size=512)
    texts = [ByteTokenizer.decode(docs.tokens(d)) for d in range(docs.num_documents)]
    assert "".join(texts) == "".join(sources)
    assert docs.num_documents > len(first)
