"""Text -> token ids -> megatron-core indexed dataset (the library behind tools/preprocess_data.py).

Tokenizers:
- "byte" (default): UTF-8 bytes are ids 0..255 and id 256 (`BYTE_EOD_ID`) ends a document,
  so the vocabulary has 257 ids and fits any model vocabulary >= 257 (the demo's is 512).
  Needs nothing installed and round-trips every text exactly.
- an HF `tokenizers` tokenizer.json (the library is imported only then); its end-of-document
  id is the token named by `eod_token`, or the first of `HF_EOD_CANDIDATES` it knows.

Every document ends with the end-of-document id unless `append_eod=False` (Megatron's
--append-eod convention): the last training position then learns to end the document.
Documents with fewer than two tokens cannot train and are dropped (and counted).
"""
from __future__ import annotations

import json
import re
from typing import Iterable, Iterator, Protocol, Sequence

import numpy as np

BYTE_VOCAB_SIZE = 257
BYTE_EOD_ID = 256
HF_EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[SEP]")
JSONL_SUFFIXES = (".jsonl", ".json")


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eod_id: int | None

    def encode(self, text: str) -> np.ndarray: ...


class ByteTokenizer:
    name = "byte"
    vocab_size = BYTE_VOCAB_SIZE
    eod_id = BYTE_EOD_ID

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    @staticmethod
    def decode(ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if int(i) != BYTE_EOD_ID).decode("utf-8", errors="replace")


class HFTokenizer:
    """A tokenizer.json of the HF `tokenizers` library."""

    def __init__(self, path: str, *, eod_token: str | None = None) -> None:
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError as err:
            raise ValueError(f"--tokenizer-json {path} needs the HF 'tokenizers' package, which is not installed "
                             f"(pip install tokenizers), or use the built-in byte tokenizer") from err
        try:
            self._tokenizer = _HFTokenizer.from_file(path)
        except Exception as err:  # tokenizers raises its own Exception types for unreadable files
            raise ValueError(f"cannot load tokenizer {path}: {err}") from err
        self.name = f"hf:{path}"
        self.vocab_size = int(self._tokenizer.get_vocab_size(with_added_tokens=True))
        names = (eod_token,) if eod_token is not None else HF_EOD_CANDIDATES
        ids = [self._tokenizer.token_to_id(n) for n in names]
        self.eod_id = next((i for i in ids if i is not None), None)
        if eod_token is not None and self.eod_id is None:
            raise ValueError(f"tokenizer {path} has no token {eod_token!r} (--eod-token)")

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)


def make_tokenizer(tokenizer_json: str | None = None, *, eod_token: str | None = None) -> Tokenizer:
    return ByteTokenizer() if tokenizer_json is None else HFTokenizer(tokenizer_json, eod_token=eod_token)


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as err:
        raise ValueError(f"cannot read input {path}: {err.strerror or err}") from err
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text (byte {err.start}: {err.reason})") from err


def _jsonl_texts(path: str, json_key: str) -> Iterator[str]:
    for line_number, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{line_number}: not a JSON object ({err.msg})") from err
        if not isinstance(record, dict) or json_key not in record:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(f"{path}:{line_number}: no key {json_key!r} (--json-key); found {keys}")
        if not isinstance(record[json_key], str):
            raise ValueError(f"{path}:{line_number}: {json_key!r} is {type(record[json_key]).__name__}, not text")
        yield record[json_key]


def iter_input_texts(paths: Sequence[str], *, json_key: str = "text",
                     split_on_blank_lines: bool = False) -> Iterator[str]:
    """Documents of the input files, in order: one per line of a .jsonl/.json file (its
    `json_key`), one per plain text file, or one per blank-line-separated block of it."""
    if not paths:
        raise ValueError("no input files given")
    for path in paths:
        if path.endswith(JSONL_SUFFIXES):
            yield from _jsonl_texts(path, json_key)
        elif split_on_blank_lines:
            yield from (block for block in re.split(r"\n(?:[ \t]*\n)+", _read_text(path)) if block.strip())
        else:
            yield _read_text(path)


def tokenize_documents(texts: Iterable[str], tokenizer: Tokenizer, *, append_eod: bool = True) -> Iterator[np.ndarray]:
    if append_eod and tokenizer.eod_id is None:
        raise ValueError(f"tokenizer {tokenizer.name} has no end-of-document token: name one with --eod-token, "
                         f"or pass --no-append-eod")
    eod = np.array([tokenizer.eod_id] if append_eod else [], dtype=np.int64)
    for text in texts:
        yield np.concatenate((tokenizer.encode(text), eod))


def preprocess_texts(texts: Iterable[str], output_prefix: str, tokenizer: Tokenizer, *,
                     append_eod: bool = True) -> dict:
    """Tokenize `texts` (one document each) into `output_prefix`.bin/.idx.

    Returns {"documents", "tokens", "dropped", "vocab_size"}."""
    from dcp_megatron.data.indexed_documents import write_indexed_documents  # imports megatron-core

    stats = write_indexed_documents(output_prefix, tokenize_documents(texts, tokenizer, append_eod=append_eod),
                                    vocab_size=tokenizer.vocab_size)
    return {**stats, "vocab_size": tokenizer.vocab_size}


def describe(stats: dict, output_prefix: str) -> str:
    return (f"wrote {output_prefix}.bin/.idx: {stats['documents']} documents, {stats['tokens']} tokens, "
            f"vocab {stats['vocab_size']}; dropped {stats['dropped']} document(s) with fewer than 2 tokens")
