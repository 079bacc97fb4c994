"""The planner's numpy-round shortcuts against the Python they replace, float for float (issue 45, third round):
first-fit packing and Python's / numpy's sums (planner/dcp/packing_rounds.py), and many micro-batches' relief choice
at once (`CostModel.best_reliefs_from_sums`)."""
import numpy as np
import pytest

from dcp_megatron.planner.costmodel import CostModel, MENU_NAMES, cluster_preset, model_preset
from dcp_megatron.planner.dcp.own_layout import _next_fit
from dcp_megatron.planner.dcp.packing_rounds import first_fit_rounds, numpy_sums, python_sums


def random_blocks(rng, max_items: int):
    counts = rng.integers(1, max_items, int(rng.integers(1, 120)))
    values = rng.random(int(counts.sum())) * 10.0 ** rng.uniform(-3, 6, int(counts.sum()))
    return values, np.cumsum(counts) - counts, counts


@pytest.mark.parametrize("seed", range(4))
def test_first_fit_rounds_and_python_sums_match_the_python_loop(seed):
    rng = np.random.default_rng(seed)
    for max_items in (3, 30, 90):
        local, lows, counts = random_blocks(rng, max_items)
        room = float(rng.choice([1e3, 2e4, 5e5]))
        chunk = first_fit_rounds(local, lows, counts, room)
        values = local.tolist()
        for lo, n in zip(lows.tolist(), counts.tolist()):
            got: dict[int, list[int]] = {}
            for i in range(lo, lo + n):
                got.setdefault(int(chunk[i]), []).append(i)
            assert [got[k] for k in range(len(got))] == _next_fit(list(range(lo, lo + n)), values, room)
        ties = rng.integers(1, 10, local.size).astype(np.float64)     # sums that reach the room exactly
        tie_chunk = first_fit_rounds(ties, lows, counts, 12.0)
        for lo, n in zip(lows.tolist(), counts.tolist()):
            got: dict[int, list[int]] = {}
            for i in range(lo, lo + n):
                got.setdefault(int(tie_chunk[i]), []).append(i)
            assert [got[k] for k in range(len(got))] == _next_fit(list(range(lo, lo + n)), ties.tolist(), 12.0)
        stacked = np.stack([local, local[::-1].copy()])
        sums = python_sums(stacked, lows, counts)
        for b, (lo, n) in enumerate(zip(lows.tolist(), counts.tolist())):
            assert sums[0, b] == sum(values[lo:lo + n]) and sums[1, b] == sum(stacked[1, lo:lo + n].tolist())


@pytest.mark.parametrize("seed", range(4))
def test_numpy_sums_match_numpy(seed):
    rng = np.random.default_rng(seed)
    for max_items in (8, 40, 200):
        values, lows, counts = random_blocks(rng, max_items)
        picks = rng.permutation(values.size)        # chunks as index lists, as the odd-group filler holds them
        sums = numpy_sums(values[picks][None, :], lows, counts)
        for b, (lo, n) in enumerate(zip(lows.tolist(), counts.tolist())):
            assert sums[0, b] == float(values[picks[lo:lo + n].tolist()].sum())


# offload across nodes: times_from_sums adds its terms in another order (an ulp apart), so those go one at a time
@pytest.mark.parametrize("model,menu", [("llama3-8b", MENU_NAMES), ("deepseek-v3-like", ("none", "offload")),
                                        ("gpt-tiny", ("selective", "full")), ("llama3-8b", ("none", "full"))])
def test_best_reliefs_from_sums_match_one_at_a_time(model, menu):
    cost = CostModel(model_preset(model), cluster_preset("h200", domain_size=64), allowed_recompute=menu)
    rng = np.random.default_rng(0)
    for cp in (1, 2, 12, 16, 64):            # 16 and 64 span nodes: offload's NIC term there
        local, compute, attn = (x * 3 for x in cost.doc_terms(rng.integers(1000, 2_000_000, 150), cp))
        firsts = rng.integers(0, 64 - cp + 1, 150)
        reliefs, times = cost.best_reliefs_from_sums(local, compute, attn, cp, firsts)
        for j in range(150):
            args = float(local[j]), float(compute[j]), float(attn[j]), cp
            relief = cost.best_recompute_from_sums(*args)
            assert reliefs[j] == relief
            expected = np.inf if relief is None else cost.time_from_sums(*args, int(firsts[j]), relief)
            assert times[j] == expected
