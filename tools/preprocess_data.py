#!/usr/bin/env python3
"""Text or jsonl files -> megatron-core indexed dataset (.bin/.idx) of whole documents.

  tools/preprocess_data.py --input a.jsonl b.jsonl --output-prefix data/corpus
  tools/preprocess_data.py --input notes/*.txt --split-on-blank-lines --output-prefix data/notes
  tools/preprocess_data.py --input a.jsonl --tokenizer-json tokenizer.json --output-prefix data/corpus

Tokenizers and the end-of-document convention: see dcp_megatron/data/preprocess.py.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dcp_megatron.data.preprocess import (  # noqa: E402
    describe,
    iter_input_texts,
    make_tokenizer,
    preprocess_texts,
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, metavar="FILE",
                        help=".jsonl/.json (one JSON object per line) or plain text files")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--json-key", default="text", help="key of the text in jsonl records (default: text)")
    parser.add_argument("--split-on-blank-lines", action="store_true",
                        help="plain text files: one document per blank-line-separated block (default: one per file)")
    parser.add_argument("--tokenizer", choices=["byte"], default="byte",
                        help="built-in tokenizer: byte = UTF-8 bytes 0..255, end-of-document 256 (vocab 257)")
    parser.add_argument("--tokenizer-json", metavar="PATH", help="HF tokenizers tokenizer.json (overrides --tokenizer)")
    parser.add_argument("--eod-token", help="end-of-document token of --tokenizer-json (default: a common name)")
    parser.add_argument("--no-append-eod", dest="append_eod", action="store_false",
                        help="do not end every document with the end-of-document token")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        tokenizer = make_tokenizer(args.tokenizer_json, eod_token=args.eod_token)
        texts = iter_input_texts(args.input, json_key=args.json_key, split_on_blank_lines=args.split_on_blank_lines)
        stats = preprocess_texts(texts, args.output_prefix, tokenizer, append_eod=args.append_eod)
    except ValueError as err:
        print(f"preprocess_data: error: {err}", file=sys.stderr)
        return 2
    print(describe(stats, args.output_prefix))
    return 0


if __name__ == "__main__":
    sys.exit(main())
