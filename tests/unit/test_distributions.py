"""Built-in length distributions and length files."""
import math

import numpy as np
import pytest

from dcp_megatron.planner.distributions import (BUCKET_TABLES, BUILTIN_NAMES, LOGNORMAL_MAX, LOGNORMAL_MIN,
                                                builtin_lengths, iter_builtin_lengths, read_lengths)


@pytest.mark.parametrize("name", BUILTIN_NAMES)
def test_deterministic_by_seed_and_prefix_stable(name):
    a = builtin_lengths(name, 10_000, seed=3)
    assert a == builtin_lengths(name, 10_000, seed=3)
    assert a != builtin_lengths(name, 10_000, seed=4)
    assert builtin_lengths(name, 5_000, seed=3) == a[:5_000]
    stream = iter_builtin_lengths(name, 3)
    assert [next(stream) for _ in range(10_000)] == a
    assert all(type(x) is int and x > 0 for x in a)


@pytest.mark.parametrize("name", sorted(BUCKET_TABLES))
def test_bucket_fractions_are_respected(name):
    table = BUCKET_TABLES[name]
    num_docs = 200_000
    lengths = np.array(builtin_lengths(name, num_docs, seed=0))
    total = sum(f for _, _, f in table)
    assert lengths.min() >= table[0][0] and lengths.max() < table[-1][1]
    for low, high, fraction in table:
        p = fraction / total
        observed = np.count_nonzero((lengths >= low) & (lengths < high))
        # binomial: within 5 standard deviations (plus one document for the tiny tail buckets)
        assert abs(observed - p * num_docs) <= 5 * math.sqrt(num_docs * p * (1 - p)) + 1, (low, high)


def test_lengths_are_log_uniform_inside_a_bucket():
    lengths = np.array(builtin_lengths("prolong", 200_000, seed=1))
    inside = lengths[(lengths >= 1024) & (lengths < 2048)]
    # log-uniform on [1024, 2048): half the mass below the geometric midpoint
    below = np.count_nonzero(inside < 1024 * math.sqrt(2)) / len(inside)
    assert abs(below - 0.5) < 0.02


def test_wikipedia_shape_matches_the_facts():
    lengths = np.array(builtin_lengths("wikipedia", 400_000, seed=0))
    assert 300 <= np.median(lengths) <= 400          # the corpus median is 347


def test_wlb_shape_matches_the_facts():
    lengths = np.array(builtin_lengths("wlb", 400_000, seed=0))
    assert 2_900 <= np.median(lengths) <= 3_600      # the list's median is 3,227
    assert 3_600 <= lengths.mean() <= 4_400          # its mean 3,962
    assert lengths.max() <= 124_913                  # a 128K context
    assert abs(np.mean(lengths >= 16_384) - 0.0134) < 0.002


def test_lognormal_mock():
    lengths = np.array(builtin_lengths("lognormal", 100_000, seed=0))
    assert lengths.min() == LOGNORMAL_MIN and lengths.max() == LOGNORMAL_MAX
    # log-normal with sigma 1.5 around mu = ln(1024) - 1.125 before clipping
    logs = np.log(lengths[(lengths > LOGNORMAL_MIN) & (lengths < LOGNORMAL_MAX)])
    assert abs(np.median(np.log(lengths)) - (math.log(1024) - 1.125)) < 0.05
    assert logs.std() > 0.8


def test_bad_builtin_arguments():
    with pytest.raises(ValueError, match="unknown built-in length distribution 'zipf'.*wikipedia"):
        builtin_lengths("zipf", 10, 0)
    with pytest.raises(ValueError, match="num_docs"):
        builtin_lengths("wikipedia", -1, 0)
    with pytest.raises(ValueError, match="seed"):
        builtin_lengths("wikipedia", 1, -2)


def test_read_lengths(tmp_path):
    path = tmp_path / "ok.txt"
    path.write_text("5\n17 \n3\n")
    assert read_lengths(str(path)) == [5, 17, 3]


@pytest.mark.parametrize("content, bad_line", [
    ("5\nabc\n7\n", 2), ("5\n7\n0\n", 3), ("-4\n", 1), ("5\n\n6\n", 2), ("1\n2\n3.5\n", 3), ("1 2\n", 1),
])
def test_read_lengths_names_the_bad_line(tmp_path, content, bad_line):
    path = tmp_path / "bad.txt"
    path.write_text(content)
    with pytest.raises(ValueError, match=f"bad.txt:{bad_line}: expected one positive integer per line"):
        read_lengths(str(path))


def test_read_lengths_missing_or_empty_file(tmp_path):
    with pytest.raises(ValueError, match="cannot read lengths file"):
        read_lengths(str(tmp_path / "nope.txt"))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty"):
        read_lengths(str(empty))
