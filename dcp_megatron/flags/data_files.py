"""The corpus of a megatron.training run checked at start: blend weights, and every .bin against its .idx.

megatron-core reads a `.bin` through the byte pointers of its `.idx` and never compares the two: a `.bin`
whose `.idx` belongs to another corpus trains silently on misread tokens, a truncated one reads past its end
deep inside a step. A blend weight of 0 or below, and a corpus of no documents, stop Megatron with a bare
assertion (or a division by zero). Here, for every prefix of `--data-path` (blends included), of
`--train/valid/test-data-path`, `--data-args-path` and `--per-split-data-args-path`, one line names the
flag and both files before anything is built. Only the .idx header and its last entry are read: O(1) per
file, whatever the corpus size.

Token ids at or above the vocabulary end step 1 with a bare `IndexError: index out of range in self` in the
embedding. With `--tokenizer-type NullTokenizer` the vocabulary is ids 0 to `--vocab-size` - 1 (megatron-core 0.19's
NullTokenizer; the embedding pads it to a multiple of 128 x TP, and ids past the padding fail), known at start: `check_token_ids` reads each .bin as the flat token array it is, in chunks, up to
`SCAN_BYTES` per file (whole files at the sizes tests and most fine-tuning corpora have; the first GiB of a larger
one), and names the flag, the file and the largest id. Other tokenizers: the same scan against the built tokenizer's
vocabulary, by the DeepSpeed script (deepspeed/setup.py) and by the Megatron path's patched train() before step 1.
"""
from __future__ import annotations

import argparse
import math
import os
import struct

from dcp_megatron.config import DcpUsageError

# megatron-core's .idx layout (megatron.core.datasets.indexed_dataset._IndexWriter): 9-byte magic, u64 version,
# u8 dtype code, u64 sequence count S, u64 document-index count D, int32[S] lengths, int64[S] byte pointers,
# int64[D] document boundaries.
_MAGIC = b"MMIDIDX\x00\x00"
_HEADER = struct.Struct("<9sQBQQ")
_ITEM_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}   # DType codes: u8 i8 i16 i32 i64 f64 f32 u16
_DTYPES = {1: "u1", 2: "i1", 3: "<i2", 4: "<i4", 5: "<i8", 6: "<f8", 7: "<f4", 8: "<u2"}
SCAN_BYTES = 1 << 30        # the most of one .bin check_token_ids reads
_CHUNK_ITEMS = 1 << 24


def blends_of(args: argparse.Namespace) -> list[tuple[str, list[str], list[float] | None]]:
    """(flag, prefixes, weights) of each data blend the run reads, as megatron.training parses them."""
    from megatron.training.utils import get_blend_and_blend_per_split

    blend, per_split = get_blend_and_blend_per_split(args)
    if blend is not None:
        flag = "--data-args-path" if args.data_args_path else "--data-path"
        return [(flag, *blend)]
    flags = (("--per-split-data-args-path",) * 3 if args.per_split_data_args_path
             else ("--train-data-path", "--valid-data-path", "--test-data-path"))
    return [(flag, *split) for flag, split in zip(flags, per_split or ()) if split is not None]


def check_data_files(args: argparse.Namespace) -> None:
    """Refuse (DcpUsageError) bad blend weights and .bin/.idx pairs (see the module docstring)."""
    if getattr(args, "mock_data", False):
        return
    for flag, prefixes, weights in blends_of(args):
        for prefix, weight in zip(prefixes, weights or [None] * len(prefixes)):
            if weight is not None and not (math.isfinite(weight) and weight > 0):
                raise DcpUsageError(f"{flag}: blend weight {weight:g} for {prefix} must be a positive number; "
                                    f"drop the dataset from the blend instead of weighting it {weight:g}")
            check_indexed_pair(prefix, flag)
    check_token_ids(args)


def check_token_ids(args: argparse.Namespace, *, vocab_size: int | None = None, what: str | None = None) -> None:
    """Every token id of the corpus (each .bin's first SCAN_BYTES) below the vocabulary: `vocab_size` (the built
    tokenizer's, `what` naming it), else NullTokenizer's --vocab-size; nothing to check for another tokenizer
    before it is built, or for mock data."""
    if getattr(args, "mock_data", False):
        return
    if vocab_size is None:
        if getattr(args, "tokenizer_type", None) != "NullTokenizer" or not getattr(args, "vocab_size", None):
            return
        vocab_size = args.vocab_size
        what = f"--vocab-size {args.vocab_size} (NullTokenizer: ids 0-{args.vocab_size - 1})"
    for flag, prefixes, _ in blends_of(args):
        for prefix in prefixes:
            largest = largest_token_id(prefix)
            if largest is not None and largest >= vocab_size:
                fix = (f"give --vocab-size {int(largest) + 1} or more" if what and what.startswith("--vocab-size")
                       else "give the tokenizer the corpus was made with")
                raise DcpUsageError(f"{flag}: {prefix}.bin holds token id {int(largest)}, outside the vocabulary of "
                                    f"{what} (the embedding would fail at step 1 with a bare IndexError): {fix}, "
                                    "or rebuild the corpus with this tokenizer")


def largest_token_id(prefix: str) -> int | float | None:
    """The largest token id of `prefix`.bin's first SCAN_BYTES (read in chunks); None for an unreadable pair."""
    import numpy as np

    try:
        with open(prefix + ".idx", "rb") as f:
            dtype_code = _HEADER.unpack(f.read(_HEADER.size))[2]
        tokens = np.memmap(prefix + ".bin", dtype=np.dtype(_DTYPES[dtype_code]), mode="r")
    except (OSError, KeyError, struct.error, ValueError):
        return None   # (check_indexed_pair names these)
    tokens = tokens[:SCAN_BYTES // tokens.itemsize]
    largest = None
    for start in range(0, len(tokens), _CHUNK_ITEMS):
        chunk_max = tokens[start:start + _CHUNK_ITEMS].max()
        largest = chunk_max if largest is None else max(largest, chunk_max)
    return None if largest is None else largest.item()


def check_indexed_pair(prefix: str, flag: str) -> None:
    """`prefix`.bin holds exactly the tokens `prefix`.idx describes, and at least one."""
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    missing = [path for path in (bin_path, idx_path) if not os.path.isfile(path)]
    if missing:
        raise DcpUsageError(f"{flag}: {' and '.join(missing)}: no such file (a dataset prefix needs both .bin "
                            "and .idx)")
    idx_bytes = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        header = f.read(_HEADER.size)
        if len(header) < _HEADER.size or header[:9] != _MAGIC:
            raise DcpUsageError(f"{flag}: {idx_path} is not a megatron-core index (.idx) file")
        _, version, dtype_code, num_sequences, num_boundaries = _HEADER.unpack(header)
        item_size = _ITEM_SIZES.get(dtype_code)
        expected_idx_bytes = _HEADER.size + 12 * num_sequences + 8 * num_boundaries
        if version != 1 or item_size is None or idx_bytes < expected_idx_bytes:
            raise DcpUsageError(f"{flag}: {idx_path} is damaged (version {version}, dtype code {dtype_code}, "
                                f"{idx_bytes} bytes for {num_sequences} sequences)")
        if num_sequences == 0:
            raise DcpUsageError(f"{flag}: {prefix} is an empty corpus ({idx_path} lists no documents); "
                                "rebuild it or drop it from the blend")
        f.seek(_HEADER.size + 4 * (num_sequences - 1))
        (last_length,) = struct.unpack("<i", f.read(4))
        f.seek(_HEADER.size + 4 * num_sequences + 8 * (num_sequences - 1))
        (last_pointer,) = struct.unpack("<q", f.read(8))
    described = last_pointer + last_length * item_size
    bin_bytes = os.path.getsize(bin_path)
    if bin_bytes != described:
        raise DcpUsageError(
            f"{flag}: {bin_path} holds {bin_bytes} bytes but {idx_path} describes {described} ({num_sequences} "
            f"sequences): the two files do not belong together (or one is truncated); rebuild the pair")
    if described == 0:
        raise DcpUsageError(f"{flag}: {prefix} is an empty corpus (its documents hold no tokens)")
