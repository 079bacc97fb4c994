"""The corpus of a megatron.training run checked at start: blend weights, and every .bin against its .idx.

megatron-core reads a `.bin` through the byte pointers of its `.idx` and never compares the two: a `.bin`
whose `.idx` belongs to another corpus trains silently on misread tokens, a truncated one reads past its end
deep inside a step. A blend weight of 0 or below, and a corpus of no documents, stop Megatron with a bare
assertion (or a division by zero). Here, for every prefix of `--data-path` (blends included), of
`--train/valid/test-data-path`, `--data-args-path` and `--per-split-data-args-path`, one line names the
flag and both files before anything is built. Only the .idx header and its last entry are read: O(1) per
file, whatever the corpus size.
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
