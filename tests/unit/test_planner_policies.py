"""Policies produce valid, deterministic plans; dcp adapts and never loses; validate catches breaks."""
import dataclasses

import numpy as np
import pytest

from dcp_megatron.planner.bounds import fewest_rank_microbatches, lower_bound
from dcp_megatron.planner.costmodel import CostModel, cluster_preset, cpu_cluster, model_preset
from dcp_megatron.planner.plan import Group, MicroBatch, Recompute, StepPlan, Wave
from dcp_megatron.planner.policies import POLICIES, make_plan
from dcp_megatron.planner.timeline import plan_makespan, rank_timeline
from dcp_megatron.planner.validate import PlanError, validate
from tests.support.planner_helpers import plans_of_every_policy, tiny_cost


def long_tailed_batch(seed: int, num: int = 300, longest: int = 24000) -> list[tuple[int, int]]:
    """Mostly short documents plus a few long ones (the shape of real pretraining data)."""
    rng = np.random.default_rng(seed)
    lengths = np.exp(rng.normal(np.log(300), 1.0, num)).astype(int).clip(1, longest)
    lengths[:3] = [longest, longest // 2, longest // 3]
    rng.shuffle(lengths)
    return [(1000 + i, int(n)) for i, n in enumerate(lengths)]


@pytest.mark.parametrize("domain_size, pp", [(8, 1), (12, 1), (6, 1), (8, 2), (12, 2)])
def test_every_policy_plans_validly_and_dcp_never_loses(domain_size, pp):
    cost = tiny_cost(domain_size, pp=pp)
    for seed in range(3):
        batch = long_tailed_batch(seed)
        bound = lower_bound(batch, cost)
        times = {}
        for policy in POLICIES:
            plan = make_plan(policy, batch, cost, max_seq_len=24000)
            validate(plan, batch, cost.cluster, cost)
            assert plan.policy == policy and plan.domain_size == domain_size
            assert plan.est_step_time_s == plan_makespan(plan)
            assert plan.lower_bound_s == bound <= plan.est_step_time_s * (1 + 1e-12)
            for wave in plan.waves:
                for group in wave.groups:
                    for mb in group.microbatches:
                        assert mb.est_mem_bytes <= cost.cluster.mem_budget_bytes
                        assert mb.est_time_s == pytest.approx(cost.microbatch_time(
                            mb.lengths, group.size, first_rank=group.first_rank, recompute=mb.recompute))
            times[policy] = plan.est_step_time_s
        assert times["dcp"] <= min(times[p] for p in POLICIES if p != "dcp")


def test_dcp_adapts_cp_size_and_recompute_to_the_batch():
    cost = tiny_cost(8)
    batch = long_tailed_batch(2)
    dcp = make_plan("dcp", batch, cost, max_seq_len=24000)
    static = make_plan("static", batch, cost, max_seq_len=24000)
    assert "fallback" not in dcp.extra
    assert len(dcp.cp_size_histogram()) >= 2                       # several CP sizes in one step
    assert set(static.cp_size_histogram()) == {static.waves[0].groups[0].size}
    recomputes = {str(mb.recompute) for w in dcp.waves for g in w.groups for mb in g.microbatches}
    assert "none" in recomputes                                      # short micro-batches skip recompute
    counts = {dcp.num_microbatches(r) for r in range(8)}
    assert len(counts) > 1                                           # variable micro-batch counts (PP = 1)
    assert dcp.est_step_time_s < static.est_step_time_s


def test_dcp_falls_back_to_a_baseline_only_when_it_would_lose():
    cost = tiny_cost(4)
    batch = [(i, 2000) for i in range(16)]                           # all equal: static is already ideal
    dcp = make_plan("dcp", batch, cost, max_seq_len=2000)
    best = min(make_plan(p, batch, cost, max_seq_len=2000).est_step_time_s for p in POLICIES if p != "dcp")
    assert dcp.est_step_time_s <= best
    if "fallback" in dcp.extra:
        assert dcp.extra["fallback"] in POLICIES and dcp.policy == "dcp"


def test_plans_are_byte_identical_for_the_same_input():
    cost = tiny_cost(12, pp=1)
    batch = long_tailed_batch(5)
    for policy in POLICIES:
        first = make_plan(policy, batch, cost, max_seq_len=24000).dumps()
        assert make_plan(policy, list(batch), tiny_cost(12), max_seq_len=24000).dumps() == first
        assert StepPlan.from_json(first).dumps() == first


def test_static_layout_is_chosen_from_the_cap_not_the_batch():
    cost = tiny_cost(8)
    short = [(i, 100) for i in range(50)]
    plan = make_plan("static", short, cost, max_seq_len=24000)
    assert plan.waves[0].groups[0].size > 1                          # the cap needs CP even if this batch does not
    counts = [len(g.microbatches) for g in plan.waves[0].groups]
    assert max(counts) - min(counts) <= 1


def test_timeline_starts_groups_when_all_members_are_done():
    cost = tiny_cost(8)
    plan = make_plan("dcp", long_tailed_batch(1), cost, max_seq_len=24000)
    slots = rank_timeline(plan)
    assert max(s.end_s for rank in slots for s in rank) == pytest.approx(plan_makespan(plan))
    for rank_slots in slots:
        ends = [s.end_s for s in rank_slots]
        starts = [s.start_s for s in rank_slots]
        assert all(a <= b + 1e-12 for a, b in zip(ends, starts[1:]))       # no overlap on a rank
    for rank_slots in slots:
        for s in rank_slots:
            members = range(s.group_first_rank, s.group_first_rank + s.group_size)
            first_of_group = s.microbatch_index == 0
            if first_of_group:
                for m in members:
                    before = [x.end_s for x in slots[m] if x.wave_index < s.wave_index]
                    assert s.start_s >= max(before, default=0.0) - 1e-12


def test_llama_on_h200_long_tailed_batch():
    cost = CostModel(model_preset("llama3-8b"), cluster_preset("h200", domain_size=32))
    rng = np.random.default_rng(0)
    lengths = np.exp(rng.normal(np.log(400), 1.4, 3000)).astype(int).clip(1, 200_000)
    lengths[0] = 200_000
    batch = [(i, int(n)) for i, n in enumerate(lengths)]
    plans = {p: make_plan(p, batch, cost, max_seq_len=200_000) for p in POLICIES}
    for plan in plans.values():
        validate(plan, batch, cost.cluster, cost)
    assert plans["dcp"].est_step_time_s < plans["static"].est_step_time_s


@pytest.mark.parametrize("batch, max_seq_len, needle", [
    ([(0, 10), (1, 0)], 100, "length 0"),
    ([(0, 10), (1, -5)], 100, "length -5"),
    ([(0, 10), (0, 20)], 100, "appears more than once"),
    ([], 100, "empty"),
    ([(0, 10), (1, 2.5)], 100, "integers"),
    ([(0, 500)], 100, "over the run's max_seq_len"),
    ([(0, 10)], 0, "max_seq_len"),
])
def test_bad_batches_raise_clear_errors(batch, max_seq_len, needle):
    with pytest.raises(ValueError, match=needle):
        make_plan("dcp", batch, tiny_cost(4), max_seq_len=max_seq_len)


def test_unknown_policy_and_unplannable_sequences():
    with pytest.raises(ValueError, match="unknown policy 'fastest'.*static"):
        make_plan("fastest", [(0, 1)], tiny_cost(4), max_seq_len=10)
    cost = tiny_cost(2)                     # two ranks hold at most ~14K tokens even with full recompute
    with pytest.raises(ValueError, match="sample 7 of 60000 tokens fits no CP group"):
        make_plan("dcp", [(7, 60000)], cost, max_seq_len=60000)
    with pytest.raises(ValueError, match="static state alone"):
        make_plan("dcp", [(0, 10)], CostModel(model_preset("llama3-8b"), cluster_preset("h200", domain_size=1)),
                  max_seq_len=10)


def _mb(*seqs, recompute=Recompute("none")):
    return MicroBatch(tuple(seqs), recompute)


@pytest.mark.parametrize("waves, needle", [
    ((Wave((Group(0, 2, (_mb((0, 10)),)), Group(2, 2, (_mb((1, 10)),)))),), None),
    ((Wave((Group(0, 2, (_mb((0, 10)),)), Group(2, 2, ()))),), "sequences"),
    ((Wave((Group(0, 2, (_mb((0, 10), (1, 10), (1, 10)),)), Group(2, 2, ()))),), "sequences"),
    ((Wave((Group(0, 2, (_mb((0, 10), (1, 11)),)), Group(2, 2, ()))),), "sequences"),
    ((Wave((Group(0, 2, (_mb((0, 10), (1, 10)),)), Group(3, 1, ()))),), "partition"),
    ((Wave((Group(0, 2, (_mb((0, 10), (1, 10)),)),)),), "partition"),
    ((Wave((Group(0, 1, ()), Group(1, 2, (_mb((0, 10), (1, 10)),)), Group(3, 1, ()))),), "alignment"),
    ((Wave((Group(0, 4, (_mb((0, 10), (1, 10)),)),)),), "CP size limit"),
    ((Wave((Group(0, 2, (_mb((0, 10), (1, 9000)),)), Group(2, 2, ()))),), "memory"),
    ((Wave((Group(0, 2, (_mb((0, 10), (1, 10), recompute=Recompute("full", 9)),)), Group(2, 2, ()))),),
     "recompute"),
    ((), "waves"),
])
def test_validate_names_the_broken_invariant(waves, needle):
    cost = tiny_cost(4, max_cp_size=2)
    batch = [(0, 10), (1, 9000)] if needle == "memory" else [(0, 10), (1, 10)]
    plan = StepPlan(domain_size=4, waves=waves)
    if needle is None:
        validate(plan, batch, cost.cluster, cost)
        return
    with pytest.raises(PlanError, match=needle):
        validate(plan, batch, cost.cluster, cost)


def test_validate_pipeline_and_domain_rules():
    cost = tiny_cost(2, pp=2)
    two = Wave((Group(0, 2, (_mb((0, 10)), _mb((1, 10)))),))
    with pytest.raises(PlanError, match="pipeline"):
        validate(StepPlan(2, (two,)), [(0, 10), (1, 10)], cost.cluster, cost)
    ok = Wave((Group(0, 2, (_mb((0, 10), (1, 10)),)),))
    validate(StepPlan(2, (ok,)), [(0, 10), (1, 10)], cost.cluster, cost)
    with pytest.raises(PlanError, match="domain size"):
        validate(StepPlan(3, (ok,)), [(0, 10), (1, 10)], cost.cluster, cost)
    other = dataclasses.replace(cost.cluster, domain_size=3)
    with pytest.raises(PlanError, match="partition"):
        validate(StepPlan(3, (ok,)), [(0, 10), (1, 10)], other, cost)


def test_lower_bound_charges_the_recompute_that_memory_forces():
    """On one rank there is no choice: documents over what a rank holds without recompute must be
    recomputed, and the bound says so (a memory-blind bound would be far below every plan)."""
    cost = tiny_cost(1)
    length = cost.max_local_tokens(Recompute("none")) + 500
    batch = [(i, length) for i in range(3)]
    bound = lower_bound(batch, cost)
    assert bound > cost.ideal_rank_seconds([n for _, n in batch]) * 1.05
    plan = make_plan("dcp", batch, cost, max_seq_len=length)
    num_mbs = plan.num_microbatches(0)
    assert all(mb.recompute.kind != "none" for w in plan.waves for g in w.groups for mb in g.microbatches)
    # no communication on one rank: the plan is exactly compute + forced recompute + overheads, and the
    # bound charges the overhead of the fewest micro-batches memory allows
    fewest = fewest_rank_microbatches([n for _, n in batch], cost)
    assert 1 <= fewest <= num_mbs
    assert bound == pytest.approx(plan.est_step_time_s - (num_mbs - fewest) * cost.cluster.microbatch_overhead_s,
                                  rel=1e-9)


def test_lower_bound_charges_the_overhead_of_the_micro_batches_memory_forces():
    """Many short documents that need no recompute: memory alone forces several micro-batches per rank,
    and each costs its overhead, so the bound is above the compute alone by at least those overheads."""
    cost = tiny_cost(2)
    most_local = max(cost.max_local_tokens(r) for r in cost.recompute_options())
    lengths = [64] * (6 * most_local // 64)           # six ranks' worth of the most a micro-batch holds
    batch = list(enumerate(lengths))
    fewest = fewest_rank_microbatches(lengths, cost)
    assert fewest >= 6
    bound = lower_bound(batch, cost)
    compute_only = cost.ideal_rank_seconds(lengths) / 2
    assert bound >= compute_only + fewest * cost.cluster.microbatch_overhead_s / 2 * (1 - 1e-12)
    for policy in ("dcp", "static"):
        assert bound <= make_plan(policy, batch, cost, max_seq_len=64).est_step_time_s * (1 + 1e-9)


def test_dcp_moves_a_document_to_a_larger_group_when_that_saves_its_recompute():
    """A document a bit over what one rank holds without recompute: on two ranks it needs none,
    which costs fewer rank-seconds here than recompute on one, so dcp runs it on two."""
    cost = CostModel(model_preset("gpt-tiny"), cpu_cluster(2))
    length = int(cost.max_local_tokens(Recompute("none")) * 1.4)
    one = float(cost.doc_alone_seconds(np.array([length]), 1)[3][0])
    two = float(cost.doc_alone_seconds(np.array([length]), 2)[3][0])
    assert 2 * two < one and cost.best_recompute([length], 1).kind == "full"   # the premise, on this preset
    batch = [(0, 4096), (1, length), (2, 700), (3, 500), (4, 300), (5, 250)]
    plan = make_plan("dcp", batch, cost, max_seq_len=4096)
    validate(plan, batch, cost.cluster, cost)
    placed = {seq_id: (g.size, mb.recompute.kind) for w in plan.waves for g in w.groups
              for mb in g.microbatches for seq_id, _ in mb.sequences}
    assert placed[1] == (2, "none") and "fallback" not in plan.extra
    assert plan.est_step_time_s < make_plan("static", batch, cost, max_seq_len=4096).est_step_time_s


def test_expert_parallel_plans_run_every_group_in_lockstep():
    """EP > 1 (PP 1): MoE all-to-alls pair the EP ranks' micro-batches, so every policy gives each group exactly
    one micro-batch per wave (equal counts on every rank), as with PP; EP 1 keeps unequal counts possible."""
    base = tiny_cost(4)
    cost = CostModel(dataclasses.replace(base.model, num_experts=4, moe_topk=2, ep=2), base.cluster)
    assert cost.model.lockstep and not base.model.lockstep
    batch = [(i, n) for i, n in enumerate([4000, 900, 300, 300, 200, 120, 64, 64, 32, 20, 16])]
    for policy, plan in plans_of_every_policy(batch, cost, max_seq_len=4096).items():
        validate(plan, batch, cost.cluster, cost)
        assert all(len(g.microbatches) == 1 for wave in plan.waves for g in wave.groups), policy
    two = Wave((Group(0, 4, (_mb((0, 10)), _mb((1, 10)))),))
    with pytest.raises(PlanError, match="ep=2"):
        validate(StepPlan(4, (two,)), [(0, 10), (1, 10)], cost.cluster, cost)
