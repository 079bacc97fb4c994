"""Split planning (planner/dcp/split.py) and the compact plan bytes the ranks gather (planner/plan_bytes.py).

A domain planned in parts is a valid plan of the whole domain: every document once, no group across two parts, the
memory of the whole domain's static state, and a step close to the whole plan's (pinned at a size the suite
affords). The bytes are the plan, and slices of two different plans are refused, not misread.
"""
import dataclasses
import itertools

import numpy as np
import pytest

from dcp_megatron.planner.batcher import GlobalBatcher
from dcp_megatron.planner.bounds import alone_times, least_rank_seconds
from dcp_megatron.planner.costmodel import GpuCosts, MENU_NAMES, CostModel, cluster_preset, model_preset
from dcp_megatron.planner.dcp.search import plan_part
from dcp_megatron.planner.dcp.split import assign_shares, compose, part_cost, split_parts
from dcp_megatron.planner.distributions import iter_builtin_lengths
from dcp_megatron.planner.layout import candidate_sizes, check_batch
from dcp_megatron.planner.plan_bytes import plan_from_bytes, plan_to_bytes
from dcp_megatron.planner.policies import checked_inputs, make_plan
from dcp_megatron.planner.timeline import plan_makespan
from dcp_megatron.planner.validate import validate
from tests.support.planner_helpers import tiny_cost

D, PART = 64, 16
TOKENS = D * 16384


def _cost(domain_size=D, *, pp=1, zero_stage=None):
    model = dataclasses.replace(model_preset("llama3-8b", pp=pp), zero_stage=zero_stage)
    return CostModel(model, cluster_preset("h200", domain_size=domain_size),
                     allowed_recompute=MENU_NAMES, gpu=GpuCosts(communicators=True))


def _batches(distribution, count=4):
    batcher = GlobalBatcher(tokens_per_step=TOKENS, max_seq_len=TOKENS, overlong="split")
    return list(itertools.islice(batcher.batches(enumerate(iter_builtin_lengths(distribution, 0))), count))


@pytest.fixture(scope="module")
def split_runs():
    cost = _cost()
    runs = []
    for distribution in ("wikipedia", "bytescale"):
        batches = _batches(distribution)
        cap = max(b.max_length for b in batches)
        for b in batches:
            runs.append((b.sequences, cap, make_plan("dcp", b.sequences, cost, max_seq_len=cap, part_ranks=PART),
                         make_plan("dcp", b.sequences, cost, max_seq_len=cap)))
    return cost, runs


def test_a_split_plan_is_a_valid_plan_of_the_whole_domain(split_runs):
    cost, runs = split_runs
    split_runs_ = [run for run in runs if "split" in run[2].extra]
    assert len(split_runs_) >= 6                                      # the split path ran (one batch is whole)
    for sequences, _, split, _ in split_runs_:
        assert split.extra["split"]["part_ranks"] in (PART, 2 * PART)
        validate(split, sequences, cost.cluster, cost)                # every document once, memory, partition
        assert split.est_step_time_s == pytest.approx(plan_makespan(split), rel=1e-12)
        for wave in split.waves:                                      # no group spans two parts
            part = split.extra["split"]["part_ranks"]
            for g in wave.groups:
                assert g.first_rank // part == (g.first_rank + g.size - 1) // part


def test_split_plans_are_close_to_whole_plans(split_runs):
    # measured 2026-12-07: split / whole step 1.000-1.068 (median 1.008) on these 8 batches (docs/simulator.md)
    _, runs = split_runs
    ratios = [split.est_step_time_s / whole.est_step_time_s for _, _, split, whole in runs]
    assert np.median(ratios) <= 1.03 and max(ratios) <= 1.08, ratios


def test_the_split_plan_is_its_parts_planned_one_by_one(split_runs):
    # what core/split_planning.py does on the ranks: each part alone, then compose (after bytes and back)
    cost, runs = split_runs
    sequences, cap, split, _ = runs[0]
    ids, lengths, _, _, bound = checked_inputs("dcp", sequences, cost, max_seq_len=cap, part_ranks=PART)
    part = split_parts(lengths, cost, PART, bound)
    part_of = assign_shares(ids, lengths, cost, D // part)
    parts = [plan_from_bytes(plan_to_bytes(plan_part(ids, lengths, cost, part_of, p, max_seq_len=cap,
                                                     part_ranks=part, bound=bound))) for p in range(D // part)]
    assert compose(parts, cost, bound) == split


def test_a_part_counts_the_whole_domains_static_memory():
    cost = _cost(4096)
    assert cost.with_cluster(domain_size=1024).static_bytes != cost.static_bytes   # the domain size matters
    assert part_cost(cost, 1024).static_bytes == cost.static_bytes
    zero3 = _cost(4096, zero_stage=3)
    assert part_cost(zero3, 1024).static_bytes == zero3.static_bytes
    assert part_cost(zero3, 1024).param_gathers == zero3.param_gathers


def test_when_a_batch_is_planned_whole():
    lengths, bound = np.array([4096] * 64), 1.0        # a bound every part meets
    assert split_parts(lengths, _cost(), PART, bound) == PART
    assert split_parts(lengths, _cost(), 0, bound) == 0                        # off
    assert split_parts(lengths, _cost(), 48, bound) == 0                       # not a divisor of the domain
    assert split_parts(lengths, _cost(), 4, bound) == 0                        # half a node
    assert split_parts(lengths, _cost(16), 16, bound) == 0                     # one part only
    assert split_parts(lengths, _cost(pp=2), PART, bound) == 0                 # lockstep: PP
    assert split_parts(lengths, _cost(zero_stage=3), PART, bound) == 0         # lockstep: ZeRO-3
    # parts grow while the longest document alone on one would end over 1% after the bound and its fastest time
    cost = _cost()
    long_doc = np.array([4096] * 63 + [400_000])
    alone = alone_times(400_000, candidate_sizes(cost.cluster), cost)
    assert alone[32] < alone[16] / 1.01 and min(alone.values()) < alone[32] / 1.01
    assert split_parts(long_doc, cost, PART, alone[16]) == 16
    assert split_parts(long_doc, cost, PART, alone[32]) == 32
    assert split_parts(long_doc, cost, PART, 0.0) == 0                         # past half the domain: whole
    with pytest.raises(ValueError, match="part_ranks is for policy 'dcp'"):
        make_plan("static", [(0, 100)], tiny_cost(4), max_seq_len=100, part_ranks=4)


def test_shares_are_balanced_and_independent_of_batch_order():
    cost = _cost()
    ids, lengths = check_batch(_batches("wikipedia", 1)[0].sequences)
    part_of = assign_shares(ids, lengths, cost, 4)
    work = least_rank_seconds(lengths, cost)
    loads = np.bincount(part_of, weights=work, minlength=4)
    assert set(part_of.tolist()) == {0, 1, 2, 3}
    # LPT's guarantee: no part leads another by more than the largest document it could have gone elsewhere
    assert loads.max() - loads.min() <= work.max() + 1e-9
    perm = np.random.default_rng(0).permutation(ids.size)
    shuffled = assign_shares(ids[perm], lengths[perm], cost, 4)
    assert dict(zip(ids[perm].tolist(), shuffled.tolist())) == dict(zip(ids.tolist(), part_of.tolist()))


def test_plan_bytes_round_trip(split_runs):
    cost, runs = split_runs
    plans = [p for _, _, split, whole in runs for p in (split, whole)]
    pipeline = _cost(pp=4)
    sequences = _batches("prolong", 1)[0].sequences
    plans.append(make_plan("dcp", sequences, pipeline, max_seq_len=max(n for _, n in sequences)))
    plans.append(make_plan("static", sequences[:8], tiny_cost(4), max_seq_len=max(n for _, n in sequences[:8])))
    reliefs = set()
    for plan in plans:
        data = plan_to_bytes(plan)
        assert plan_from_bytes(data) == plan and plan_to_bytes(plan_from_bytes(data)) == data
        assert plan_from_bytes(data).extra == plan.extra
        reliefs |= {mb.recompute for w in plan.waves for g in w.groups for mb in g.microbatches}
    assert len(reliefs) >= 3        # the table of reliefs is exercised, not only "none"


def test_slices_of_two_plans_are_refused(split_runs):
    _, runs = split_runs
    a, b = plan_to_bytes(runs[0][2]), plan_to_bytes(runs[1][2])
    for mixed in (a[:len(a) // 2] + b[len(a) // 2:], a[:len(a) - 5], b[:40] + a[40:], a + b"\0" * 8):
        if mixed != a and mixed != b:
            with pytest.raises(ValueError, match="plan's bytes"):
                plan_from_bytes(mixed)


def test_default_part_size_splits_large_domains_only():
    from dcp_megatron.config import DcpConfig, DcpUsageError, part_ranks_of
    config = DcpConfig(seq_length=4096)
    assert [part_ranks_of(config, d) for d in (1024, 4096, 8192, 16384)] == [0, 0, 1024, 1024]
    assert part_ranks_of(DcpConfig(seq_length=4096, plan_part_ranks=0), 16384) == 0
    assert part_ranks_of(DcpConfig(seq_length=4096, plan_part_ranks=512), 1024) == 512
    with pytest.raises(DcpUsageError, match="--dcp-plan-part-ranks must be an int >= 0"):
        DcpConfig(seq_length=4096, plan_part_ranks=-1)
