#!/usr/bin/env python3
"""Build a small real-text indexed dataset from the Python standard library's own sources.

Every machine with Python has them, so the CPU demo needs no download. Documents are the
top-level definitions (a def/class with its decorators, or the code between them) of the
stdlib's top-level modules, read in sorted order: real text whose lengths are long-tailed
(a few bytes to ~100K), like a pretraining corpus. `--unit file` makes each module one
document instead. Same tokenizer and writer as tools/preprocess_data.py (byte-level).
The exact content follows the installed Python version; for one version it is fixed.

  tools/make_demo_data.py --output-prefix data/stdlib
"""
import argparse
import os
import sys
import sysconfig
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dcp_megatron.data.preprocess import ByteTokenizer, describe, preprocess_texts  # noqa: E402

_DEFINITION_STARTS = ("def ", "class ", "async def ", "@")


def split_definitions(source: str) -> list[str]:
    """Cut a module before every top-level def/class/decorator that follows a blank line."""
    blocks, current = [], []
    previous_blank = False
    for line in source.splitlines(keepends=True):
        if previous_blank and line.startswith(_DEFINITION_STARTS) and any(s.strip() for s in current):
            blocks.append("".join(current))
            current = []
        current.append(line)
        previous_blank = not line.strip()
    if any(s.strip() for s in current):
        blocks.append("".join(current))
    return blocks


def stdlib_texts(*, unit: str, max_files: int | None) -> list[str]:
    stdlib = sysconfig.get_paths()["stdlib"]
    names = sorted(n for n in os.listdir(stdlib) if n.endswith(".py"))[:max_files]
    texts = []
    for name in names:
        with open(os.path.join(stdlib, name), encoding="utf-8", errors="replace") as f:
            source = f.read()
        texts.extend(split_definitions(source) if unit == "definition" else [source])
    return texts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--unit", choices=["definition", "file"], default="definition",
                        help="one document per top-level definition (default) or per module file")
    parser.add_argument("--max-files", type=int, default=None, help="use only the first N modules (sorted)")
    parser.add_argument("--max-document-tokens", type=int, default=None,
                        help="leave out documents longer than this many tokens (default: keep all)")
    args = parser.parse_args(argv)
    if args.max_files is not None and args.max_files < 1:
        parser.error(f"--max-files must be >= 1, got {args.max_files}")
    if args.max_document_tokens is not None and args.max_document_tokens < 2:
        parser.error(f"--max-document-tokens must be >= 2, got {args.max_document_tokens}")

    start = time.perf_counter()
    tokenizer = ByteTokenizer()
    texts = stdlib_texts(unit=args.unit, max_files=args.max_files)
    if args.max_document_tokens is not None:
        kept = [t for t in texts if len(t.encode("utf-8")) + 1 <= args.max_document_tokens]
        print(f"left out {len(texts) - len(kept)} document(s) longer than {args.max_document_tokens} tokens")
        texts = kept
    try:
        stats = preprocess_texts(texts, args.output_prefix, tokenizer)
    except ValueError as err:
        print(f"make_demo_data: error: {err}", file=sys.stderr)
        return 2
    print(describe(stats, args.output_prefix))
    lengths = np.array([len(t.encode("utf-8")) + 1 for t in texts])
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99]).astype(int)
    print(f"document tokens: median {p50}, p90 {p90}, p99 {p99}, max {lengths.max()} "
          f"({time.perf_counter() - start:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
