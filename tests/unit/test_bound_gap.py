"""The lower bound against exact references, the MILP reference (milp_reference.py), the bytescale
distribution's shape, and tools/bound_gap.py end to end."""
import itertools
import json
import math

import numpy as np
import pytest

from dcp_megatron.planner.bounds import (exact_alone_time, fastest_alone_time, least_rank_seconds,
                                         least_recompute_extra, lower_bound, scored_sizes)
from dcp_megatron.planner.costmodel import CostModel, cluster_preset, model_preset
from dcp_megatron.planner.distributions import BYTESCALE_BUCKETS, BYTESCALE_MAX, builtin_lengths
from dcp_megatron.planner.milp_reference import family_bound, solve_family, split_long
from dcp_megatron.planner.policies import make_plan
from tests.support.planner_helpers import tiny_cost
from tests.support.tool_helpers import load_tool

# measured attention times (cp rows 1, 4, 16) exercise the bound's profile branch
PROFILE = {"attention_times": [[1024, 1, 1e-3], [8192, 1, 3e-2], [65536, 1, 1.5], [1024, 4, 4e-4],
                               [65536, 4, 0.5], [65536, 16, 0.15]]}


def h200_cost(domain_size: int, profile=None) -> CostModel:
    return CostModel(model_preset("llama3-8b"), cluster_preset("h200", domain_size=domain_size), profile=profile)


def exact_rank_seconds(length: int, size: int, cost) -> float:
    """size x (compute + least recompute that fits) of one document alone, the bound's per-size charge."""
    local, compute, attn = cost.doc_terms(np.array([length]), size)
    return float(size * (compute[0] + least_recompute_extra(local, compute, attn, cost)[0]))


def fastest_alone(length: int, cost) -> float:
    """Brute force over every group size and offset: the shortest step of a one-document batch."""
    D, best = cost.cluster.domain_size, math.inf
    for size in range(1, D + 1):
        recompute = cost.best_recompute([length], size)
        if recompute is None:
            continue
        for first in range(0, D - size + 1):
            best = min(best, cost.microbatch_time([length], size, first_rank=first, recompute=recompute))
    return best


@pytest.mark.parametrize("domain_size,profile", [(16, None), (64, None), (128, None), (48, PROFILE), (128, PROFILE)])
def test_least_rank_seconds_never_exceeds_any_group_size(domain_size, profile):
    cost = h200_cost(domain_size, profile)
    cap = cost.max_local_tokens(cost.strongest_recompute) * domain_size
    lengths = np.unique(np.r_[np.geomspace(16_000, cap, 40).astype(np.int64), [650_872, 574_934]])
    lengths = lengths[lengths <= cap]
    least = least_rank_seconds(lengths, cost)
    for length, bound in zip(lengths.tolist(), least.tolist()):
        every = [exact_rank_seconds(length, c, cost) for c in range(1, domain_size + 1)]
        assert bound <= min(every) * (1 + 1e-12), (length, bound, min(every))
        if domain_size <= 64:           # every size is scored: the bound is the exact minimum
            assert bound == pytest.approx(min(every), rel=1e-12)


def test_scored_sizes_cover_small_domains_and_grid_large_ones():
    assert scored_sizes(h200_cost(64).cluster) == list(range(1, 65))
    large = scored_sizes(h200_cost(1024).cluster)
    assert large[:64] == list(range(1, 65)) and large[-1] == 1024 and 512 in large
    assert max(b / a for a, b in zip(large[63:], large[64:])) <= 1.0625 * 65 / 64


@pytest.mark.parametrize("domain_size", [8, 12, 64])
def test_bound_of_one_document_never_beats_brute_force(domain_size):
    cost = h200_cost(domain_size)
    for length in (20_000, 90_000, 333_333, 650_872):
        if cost.best_recompute([length], domain_size) is None:
            continue
        assert lower_bound([(0, length)], cost) <= fastest_alone(length, cost) * (1 + 1e-12)


@pytest.mark.parametrize("domain_size", [8, 12, 64])
def test_exact_alone_time_is_the_brute_force_over_every_size_and_offset(domain_size):
    cost = h200_cost(domain_size)
    for length in (20_000, 90_000, 333_333, 650_872):
        assert exact_alone_time(length, cost) == pytest.approx(fastest_alone(length, cost), rel=1e-12)


def test_exact_alone_time_counts_the_communication_the_bound_floor_leaves_out():
    # at thousands of ranks a long document's K/V all-gather is most of its time on any group size
    cost = h200_cost(4096)
    relaxed, exact = fastest_alone_time(1_197_350, cost), exact_alone_time(1_197_350, cost)
    assert exact > 3 * relaxed
    assert exact <= min(cost.microbatch_time([1_197_350], c, recompute=cost.best_recompute([1_197_350], c))
                        for c in (1024, 2048, 4096))


def family_instance(seed: int, cost):
    """Long documents that pair nowhere without recompute (local over half the room at every size) plus
    short filler: every dcp plan of it runs each long document alone, a plan of the MILP's family."""
    room, D = cost.max_local_tokens(cost.base_recompute), cost.cluster.domain_size
    rng = np.random.default_rng(seed)
    most = D * cost.max_local_tokens(cost.strongest_recompute)          # what fits the whole domain at all
    long = rng.integers(D * room // 2 + 2 * D, min(5 * D * room, most), size=int(rng.integers(3, 8)))
    filler = np.array(builtin_lengths("wikipedia", 200, seed))
    filler = filler[filler <= room]
    return list(enumerate(np.r_[long, filler].tolist()))


@pytest.mark.parametrize("seed", range(4))
def test_milp_optimum_lies_between_the_bound_and_the_dcp_plan(seed):
    cost = h200_cost(8)
    batch = family_instance(seed, cost)
    lengths = [length for _, length in batch]
    result = solve_family(lengths, cost, time_limit_s=20)
    assert result.optimal and result.num_long == len(split_long(np.array(lengths), cost)[0]) >= 3
    bound = lower_bound(batch, cost)
    plan = make_plan("dcp", batch, cost, max_seq_len=max(lengths))
    assert bound <= result.dual_bound_s * (1 + 1e-9)
    assert result.dual_bound_s <= result.value_s * (1 + 1e-6)
    assert family_bound(lengths, cost) <= result.value_s * (1 + 1e-9)
    sizes = {g.size for w in plan.waves for g in w.groups}
    if "fallback" not in plan.extra and all(c & (c - 1) == 0 for c in sizes):   # a plan of the family
        assert result.value_s <= plan.est_step_time_s * (1 + 1e-6)


def test_an_odd_group_for_the_longest_document_shortens_a_bytescale_step(monkeypatch):
    import dcp_megatron.planner.dcp.odd_groups as dcp_odd
    from dcp_megatron.planner.batcher import GlobalBatcher
    from dcp_megatron.planner.distributions import iter_builtin_lengths
    from dcp_megatron.planner.validate import validate

    cost = h200_cost(64)
    batcher = GlobalBatcher(tokens_per_step=2 ** 24, max_seq_len=2 ** 24)
    step = next(b for b in batcher.batches(enumerate(iter_builtin_lengths("bytescale", 0))) if b.max_length == 650_872)
    plan = make_plan("dcp", step.sequences, cost, max_seq_len=BYTESCALE_MAX)
    validate(plan, step.sequences, cost.cluster, cost)
    odd = [g for w in plan.waves for g in w.groups if g.size & (g.size - 1)]
    longest = [g for g in odd if g.microbatches[0].lengths == [650_872]]
    assert len(longest) == 1 and longest[0].first_rank == 0 and 32 < longest[0].size < 64
    monkeypatch.setattr(dcp_odd, "MIN_GAIN", math.inf)
    power_of_two = make_plan("dcp", step.sequences, cost, max_seq_len=BYTESCALE_MAX)
    assert plan.lower_bound_s <= plan.est_step_time_s < power_of_two.est_step_time_s * (1 - 0.005)


def test_milp_reference_rejects_bad_input():
    with pytest.raises(ValueError, match="power-of-two domain"):
        solve_family([100, 20_000], h200_cost(12))
    with pytest.raises(ValueError, match="time_limit_s"):
        solve_family([100], tiny_cost(4), time_limit_s=0)


def test_bytescale_shape():
    lengths = np.array(builtin_lengths("bytescale", 400_000, seed=0))
    assert sum(f for _, _, f in BYTESCALE_BUCKETS) == pytest.approx(1.0)
    assert sum(f for lo, hi, f in BYTESCALE_BUCKETS if hi <= 4096) == pytest.approx(0.80)
    assert abs(np.mean(lengths < 4096) - 0.80) < 0.005
    assert lengths.max() <= BYTESCALE_MAX == 2 ** 21
    assert np.count_nonzero(lengths == BYTESCALE_MAX) > 0          # the 2M point mass
    assert 5_000 < lengths.mean() < 6_600                         # about 2,900 documents per 16M tokens


def test_bound_gap_tool_end_to_end(tmp_path, capsys):
    tool = load_tool("bound_gap")
    out = tmp_path / "gap.json"
    assert tool.main(["--workloads", "bytescale", "--steps", "2", "--milp-instances", "1", "--exact-longest",
                      "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    workload = report["workloads"]["bytescale"]
    assert workload["steps"] == 2 and 1.0 <= workload["p50"] <= workload["p95"] <= workload["max"]
    assert sum(b["steps"] for b in workload["bins"].values()) == 2
    assert 1.0 <= workload["vs_exact_longest"]["p50"] <= workload["p50"] * (1 + 1e-12)   # a tighter bound
    row = report["milp"][0]
    assert row["bound_s"] <= row["milp_dual_s"] * (1 + 1e-9) and row["milp_s"] <= row["dcp_s"] * 1.01
    assert "reduced bytescale instances" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        tool.main(["--workloads", "zipf"])


@pytest.mark.parametrize("workload, domain_size, tokens_per_step", [
    ("wikipedia", 32, 4_194_304), ("prolong", 32, 4_194_304), ("wlb", 32, 4_194_304), ("bytescale", 64, 16_777_216)])
def test_dcp_plans_stay_within_a_percent_and_a_half_of_the_bound(workload, domain_size, tokens_per_step):
    # The four mixes of docs/simulator.md at its sizes, the first three steps: dcp's median step over the lower
    # bound is 1.003-1.012 there (the documented p50 over more steps: 1.005-1.009); a planner change that loosens
    # the plans (megatron-dynamic's layout alone sits at 1.05-1.17) fails here, one that speeds planning must not.
    from dcp_megatron.planner.batcher import GlobalBatcher
    from dcp_megatron.planner.distributions import iter_builtin_lengths

    cost = h200_cost(domain_size)
    batcher = GlobalBatcher(tokens_per_step=tokens_per_step, max_seq_len=tokens_per_step, overlong="split")
    batches = list(itertools.islice(batcher.batches(enumerate(iter_builtin_lengths(workload, 0))), 3))
    max_seq_len = max(b.max_length for b in batches)
    gaps = []
    for batch in batches:
        plan = make_plan("dcp", batch.sequences, cost, max_seq_len=max_seq_len)
        gaps.append(plan.est_step_time_s / plan.lower_bound_s)
    assert 1.0 <= float(np.median(gaps)) <= 1.015, gaps
