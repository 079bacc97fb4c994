"""Document-length distributions: built-in ones written down as facts, and length files.

Built-ins are bucket tables: the fraction of documents whose length falls in each bucket
[low, high), with lengths drawn log-uniformly inside a bucket. The tables are histograms of
real corpora (the corpora themselves are not shipped; only these fractions are):

- "wikipedia": 1,000,000 Wikipedia documents with GPT-2-like tokens as used by FlexSP
  (PKU-DAIR/Hetu-Galvatron, branch flexsp, galvatron/datasets/wikipedia.txt): median 347 tokens, mean 1,014,
  max 1,823,777. Fractions are documents per bucket / 1,000,000; the three longest
  power-of-two buckets above 256K held 6 + 0 + 1 documents and are merged into one.
- "prolong": a ProLong-style long-context mix as used by DistCA (hao-ai-lab/distca, dist_prolong.json,
  77,932 documents): min 575, median 1,914, mean 3,052, max 340,149 tokens.
- "bytescale": a ByteScale-like production mix (the shape ByteScale, Ge et al. 2025, describes
  for its long-context training data: about 80% of documents under 4K tokens and a heavy tail
  to the 2M context), NOT ByteScale's data: the fractions below are this project's choice.
  80.0% of documents are under 4K; 0.008% are exactly 2,097,152 tokens (documents truncated at
  a 2M context, a point mass); mean about 5.8K tokens, so a 16M-token step holds about 2,900
  documents, and about one step in five holds a 2M document.
- "wlb": a WLB-LLM-like mix (the length list DistCA compares WLB-LLM on: hao-ai-lab/distca,
  distca/simulator/data/dist_wlbllm.json, 99,519 documents): median 3,227, mean 3,962, max 124,913
  tokens (a 128K context); two thirds between 2K and 6.25K, 1.3% over 16K. Fractions are documents
  per bucket / 99,519; the 4K-8K bucket is split at 6,250 (all but 394 of its documents are under it).
- "lognormal": Megatron's mock length distribution, not a table: log-normal with
  sigma 1.5 and mu = ln(1024) - sigma^2/2 (so the unclipped mean is 1024 tokens), clipped to
  [128, 8192].

Draws are deterministic in (name, seed) and prefix-stable: the first n lengths of a longer
draw equal a draw of n, because documents come in fixed-size blocks, each from its own
numpy generator seeded by (seed, block index). A stream can therefore be extended lazily.
"""
from __future__ import annotations

import itertools
import math
from typing import Iterator

import numpy as np

# (low inclusive, high exclusive, fraction of documents)
BucketTable = tuple[tuple[int, int, float], ...]

WIKIPEDIA_BUCKETS: BucketTable = (
    (1, 32, 0.005252),
    (32, 64, 0.037073),
    (64, 128, 0.170126),
    (128, 256, 0.202934),
    (256, 512, 0.210819),
    (512, 1024, 0.161687),
    (1024, 2048, 0.108518),
    (2048, 4096, 0.059627),
    (4096, 8192, 0.027972),
    (8192, 16384, 0.011221),
    (16384, 32768, 0.003467),
    (32768, 65536, 0.001027),
    (65536, 131072, 0.000228),
    (131072, 262144, 0.000042),
    (262144, 1823778, 0.000007),
)

PROLONG_BUCKETS: BucketTable = (     # documents per bucket / 77,932
    (575, 1024, 0.149374),
    (1024, 2048, 0.384297),
    (2048, 4096, 0.269607),
    (4096, 8192, 0.144138),
    (8192, 16384, 0.042730),
    (16384, 32768, 0.007789),
    (32768, 65536, 0.001463),
    (65536, 131072, 0.000385),
    (131072, 262144, 0.000167),
    (262144, 340150, 0.000051),
)

BYTESCALE_MAX = 2_097_152
BYTESCALE_BUCKETS: BucketTable = (   # a ByteScale-like shape (this project's fractions, not ByteScale's data)
    (1, 128, 0.10),
    (128, 512, 0.25),
    (512, 1024, 0.20),
    (1024, 2048, 0.15),
    (2048, 4096, 0.10),               # 80% of documents end here, under 4K
    (4096, 8192, 0.08),
    (8192, 16384, 0.055),
    (16384, 32768, 0.035),
    (32768, 65536, 0.018),
    (65536, 131072, 0.0075),
    (131072, 262144, 0.0030),
    (262144, 524288, 0.0010),
    (524288, 1048576, 0.00030),
    (1048576, BYTESCALE_MAX, 0.00012),
    (BYTESCALE_MAX, BYTESCALE_MAX + 1, 0.00008),   # truncated at the 2M context
)

WLB_BUCKETS: BucketTable = (       # documents per bucket / 99,519
    (1, 32, 0.004934),
    (32, 64, 0.005125),
    (64, 128, 0.009697),
    (128, 256, 0.020177),
    (256, 512, 0.039209),
    (512, 1024, 0.080367),
    (1024, 2048, 0.157809),
    (2048, 4096, 0.319547),
    (4096, 6250, 0.335454),
    (6250, 8192, 0.003959),
    (8192, 16384, 0.010360),
    (16384, 32768, 0.004512),
    (32768, 65536, 0.003547),
    (65536, 124914, 0.005306),
)

LOGNORMAL_MIN, LOGNORMAL_MAX, LOGNORMAL_MEAN, LOGNORMAL_SIGMA = 128, 8192, 1024, 1.5

BUCKET_TABLES: dict[str, BucketTable] = {"wikipedia": WIKIPEDIA_BUCKETS, "prolong": PROLONG_BUCKETS,
                                          "bytescale": BYTESCALE_BUCKETS, "wlb": WLB_BUCKETS}
BUILTIN_NAMES = ("wikipedia", "prolong", "lognormal", "bytescale", "wlb")

_BLOCK_SIZE = 4096


def _draw_from_table(table: BucketTable, rng: np.random.Generator, size: int) -> np.ndarray:
    lows = np.array([b[0] for b in table], dtype=np.float64)
    highs = np.array([b[1] for b in table], dtype=np.float64)
    fractions = np.array([b[2] for b in table], dtype=np.float64)
    bucket = rng.choice(len(table), size=size, p=fractions / fractions.sum())
    log_low, log_high = np.log(lows[bucket]), np.log(highs[bucket])
    lengths = np.floor(np.exp(rng.uniform(log_low, log_high))).astype(np.int64)
    # exp(log(high)) can round up to high itself; the bucket is half-open.
    return np.clip(lengths, lows[bucket].astype(np.int64), highs[bucket].astype(np.int64) - 1)


def _draw_lognormal(rng: np.random.Generator, size: int) -> np.ndarray:
    mu = math.log(LOGNORMAL_MEAN) - LOGNORMAL_SIGMA ** 2 / 2
    lengths = np.rint(rng.lognormal(mu, LOGNORMAL_SIGMA, size=size)).astype(np.int64)
    return np.clip(lengths, LOGNORMAL_MIN, LOGNORMAL_MAX)


def _draw_block(name: str, seed: int, block_index: int) -> np.ndarray:
    rng = np.random.default_rng([seed, block_index])
    if name == "lognormal":
        return _draw_lognormal(rng, _BLOCK_SIZE)
    return _draw_from_table(BUCKET_TABLES[name], rng, _BLOCK_SIZE)


def _check_name_seed(name: str, seed: int) -> None:
    if name not in BUILTIN_NAMES:
        raise ValueError(f"unknown built-in length distribution {name!r}; choose one of {list(BUILTIN_NAMES)}")
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")


def iter_builtin_lengths(name: str, seed: int) -> Iterator[int]:
    """Endless, deterministic stream of document lengths from a built-in distribution."""
    _check_name_seed(name, seed)
    for block_index in itertools.count():
        yield from _draw_block(name, seed, block_index).tolist()


def builtin_lengths(name: str, num_docs: int, seed: int) -> list[int]:
    """The first `num_docs` lengths of `iter_builtin_lengths(name, seed)`."""
    _check_name_seed(name, seed)
    if not isinstance(num_docs, int) or num_docs < 0:
        raise ValueError(f"num_docs must be a non-negative int, got {num_docs!r}")
    return list(itertools.islice(iter_builtin_lengths(name, seed), num_docs))


def read_lengths(path: str) -> list[int]:
    """Lengths from a text file with one positive integer per line.

    Any other line (blank, text, zero, negative, fractional) is an error naming the file
    and line number; trailing whitespace and a final newline are fine."""
    lengths: list[int] = []
    try:
        with open(path, encoding="utf-8") as f:
            for line_number, line in enumerate(f, start=1):
                text = line.strip()
                if not (text.isascii() and text.isdigit()) or int(text) <= 0:
                    raise ValueError(f"{path}:{line_number}: expected one positive integer per line, "
                                     f"got {line.rstrip(chr(10))!r}")
                lengths.append(int(text))
    except OSError as err:
        raise ValueError(f"cannot read lengths file {path!r}: {err.strerror or err}") from err
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not a UTF-8 text file of lengths ({err.reason})") from err
    if not lengths:
        raise ValueError(f"{path}: no lengths (the file is empty)")
    return lengths
