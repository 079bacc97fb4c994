"""The planner's fast paths give exactly what their plain versions give, and dcp with PP > 1
plans mixed-size waves that validate."""
import heapq

import numpy as np
import pytest

from dcp_megatron.planner.plan import NO_RECOMPUTE, SELECTIVE, Recompute, StepPlan
from dcp_megatron.planner.policies import make_plan
from dcp_megatron.planner.layout import assemble_waves, candidate_sizes, check_batch, min_fitting_size
from dcp_megatron.planner.padding import local_tokens
from dcp_megatron.planner.list_scheduling import lpt_assign, lpt_assign_rounds
from dcp_megatron.planner.dcp.sized_sequences import SizedSequences
from dcp_megatron.planner.dcp.waves import plan_mixed_waves
from dcp_megatron.planner.baselines.hybrid import _double_into_free, _first_fit, _place
from dcp_megatron.planner.timeline import plan_makespan
from dcp_megatron.planner.validate import validate
from tests.support.planner_helpers import tiny_cost
from tests.unit.test_planner_policies import long_tailed_batch


def heap_lpt(times, loads):
    heap = [(load, b) for b, load in enumerate(loads)]
    heapq.heapify(heap)
    where = []
    for t in times:
        load, b = heapq.heappop(heap)
        heapq.heappush(heap, (load + t, b))
        where.append(b)
    return where


@pytest.mark.parametrize("num_bins", [1, 5, 64, 200, 1024])
def test_lpt_rounds_match_the_heap_exactly(num_bins):
    rng = np.random.default_rng(num_bins)
    for case in range(6):
        n = int(rng.integers(0, 5 * num_bins + 50))
        times = np.sort(rng.lognormal(0.0, 1.5 if case % 2 else 0.2, n))[::-1]
        if case == 2:
            times = np.round(times, 1)                       # many ties between items and loads
        loads = np.zeros(num_bins) if case < 2 else np.round(rng.uniform(0, times.sum() / num_bins + 1, num_bins), 1)
        where, final = lpt_assign_rounds(times, loads)
        assert where.tolist() == heap_lpt(times.tolist(), loads.tolist())
        assert where.tolist() == lpt_assign(times.tolist(), loads.tolist())[0]
        np.testing.assert_allclose(final, loads + np.bincount(where, weights=times, minlength=num_bins))


def test_min_fitting_size_is_the_smallest_size_that_holds_the_sequence():
    cost = tiny_cost(12)
    sizes = candidate_sizes(cost.cluster)
    cap = cost.max_local_tokens(Recompute("full", cost.layers_per_stage))
    lengths = np.array(sorted({1, 2, cap - 1, cap, cap + 1, 2 * cap, 2 * cap + 1, 5 * cap, 12 * cap - 3} |
                              set(np.random.default_rng(0).integers(1, 12 * cap, 300).tolist())))
    lengths = lengths[lengths <= 12 * cap - 24]
    idx = min_fitting_size(lengths, np.arange(lengths.size), sizes, cost)
    for L, i in zip(lengths.tolist(), idx.tolist()):
        fits = [local_tokens(np.array([L]), s)[0] <= cap for s in sizes]
        assert i == fits.index(True)
    with pytest.raises(ValueError, match="fits no CP group"):
        min_fitting_size(np.array([12 * cap + 100]), np.array([7]), sizes, cost)


def test_vectorised_times_equal_the_scalar_cost():
    cost = tiny_cost(16, gpus_per_node=4)
    rng = np.random.default_rng(1)
    local = rng.uniform(0, 3000, 40)
    local[0] = 0.0
    compute, attn = rng.uniform(0, 1e-2, 40), rng.uniform(0, 1e-3, 40)
    firsts = rng.integers(0, 12, 40)
    sizes = rng.choice([1, 2, 3, 4, 8], 40)
    for rc in (NO_RECOMPUTE, SELECTIVE, Recompute("full", 1), Recompute("full", cost.layers_per_stage)):
        got = cost.times_from_sums(local, compute, attn, sizes, firsts, rc)
        want = [cost.time_from_sums(*args, rc) for args in zip(local, compute, attn, sizes.tolist(), firsts.tolist())]
        assert got.tolist() == want


def test_fewest_full_layers_is_the_first_that_fits():
    cost = tiny_cost(4)
    room = cost.cluster.mem_budget_bytes - cost.static_bytes
    n = cost.layers_per_stage
    for local in np.linspace(0, cost.max_local_tokens(Recompute("full", n)) * 1.2, 97).tolist():
        fits = [k for k in range(1, n + 1) if local * cost.bytes_per_local_token(Recompute("full", k)) <= room]
        assert cost._fewest_full_layers(local, room) == (fits[0] if fits else None)


@pytest.mark.parametrize("domain_size", [8, 16, 12])
def test_hybrid_placement_fast_path_matches_first_fit(domain_size):
    rng = np.random.default_rng(domain_size)
    for _ in range(20):
        sizes = sorted(rng.choice([1, 2, 4, 8], int(rng.integers(1, 40))).tolist(), reverse=True)
        if domain_size % max(sizes):
            continue
        limit = domain_size
        wave_of, first_of, size_of = _place(sizes, domain_size, limit)
        ref_wave, ref_first, busy = _first_fit(sizes, domain_size)
        ref_size = list(sizes)
        for w, occupied in enumerate(busy):
            _double_into_free([b for b in range(len(sizes)) if ref_wave[b] == w], ref_first, ref_size, occupied,
                              domain_size, limit)
        assert (wave_of, first_of, size_of) == (ref_wave, ref_first, ref_size)


def test_assemble_waves_keeps_each_ranks_order_and_fills_idle_ranks():
    cost = tiny_cost(8)
    batch = long_tailed_batch(3)
    plan = make_plan("dcp", batch, cost, max_seq_len=24000)
    groups = [g for w in plan.waves for g in w.groups if g.microbatches]
    again = assemble_waves(8, groups)
    assert StepPlan(domain_size=8, waves=again).dumps() == StepPlan(domain_size=8, waves=plan.waves).dumps()
    assert assemble_waves(3, [])[0].groups[2].first_rank == 2


@pytest.mark.parametrize("domain_size, pp", [(8, 2), (8, 4), (16, 2), (6, 2), (12, 4)])
def test_dcp_pipeline_mixes_sizes_in_a_wave_one_microbatch_per_group(domain_size, pp):
    cost = tiny_cost(domain_size, pp=pp)
    mixed_waves = 0
    for seed in range(3):
        batch = long_tailed_batch(seed, num=400)
        ids, lengths = check_batch(batch)
        sizes = candidate_sizes(cost.cluster)
        seqs = SizedSequences(lengths, sizes, min_fitting_size(lengths, ids, sizes, cost), cost)
        seqs.grow_long_sequences(domain_size, len(sizes) - 1)
        mixed = plan_mixed_waves(ids, lengths, cost, seqs)   # None: a block no allowed recompute holds
        plan = make_plan("dcp", batch, cost, max_seq_len=24000)
        validate(plan, batch, cost.cluster, cost)
        if mixed is not None:
            own = StepPlan(domain_size=domain_size, waves=mixed)
            validate(own, batch, cost.cluster, cost)     # partition, alignment, one micro-batch per group
            mixed_waves += sum(len({g.size for g in w.groups if g.microbatches[0].sequences}) > 1 for w in own.waves)
            assert plan.est_step_time_s <= plan_makespan(own) * (1 + 1e-12)
        for policy in ("static", "static-balanced", "megatron-hybrid", "megatron-dynamic"):
            other = make_plan(policy, batch, cost, max_seq_len=24000)
            assert plan.est_step_time_s <= other.est_step_time_s * (1 + 1e-12)
    assert mixed_waves > 0


def test_dcp_pipeline_is_deterministic_and_handles_a_single_sequence():
    cost = tiny_cost(8, pp=2)
    batch = long_tailed_batch(5)
    assert make_plan("dcp", batch, cost, max_seq_len=24000).dumps() == \
        make_plan("dcp", list(batch), cost, max_seq_len=24000).dumps()
    for one in ([(1, 1)], [(9, 24000)]):
        plan = make_plan("dcp", one, cost, max_seq_len=24000)
        validate(plan, one, cost.cluster, cost)
