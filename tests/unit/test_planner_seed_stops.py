"""dcp's seeds that cannot win stop early (baselines/dynamic_stop.py `EndsTooLate`, hybrid.py
`_longest_bucket_stays`): what they return with `must_beat` is what the whole schedule would, and they do stop."""
import dataclasses
import itertools

import numpy as np
import pytest

from dcp_megatron.planner.baselines import dynamic_stop, hybrid, megatron_dynamic
from dcp_megatron.planner.batcher import GlobalBatcher
from dcp_megatron.planner.costmodel import CostModel, MENU_NAMES, cluster_preset, model_preset
from dcp_megatron.planner.distributions import iter_builtin_lengths
from dcp_megatron.planner.plan import StepPlan
from dcp_megatron.planner.policies import make_plan
from dcp_megatron.planner.timeline import plan_makespan


def _h200_batch(domain: int, mix: str, seed: int):
    cost = CostModel(model_preset("llama3-8b"), cluster_preset("h200", domain_size=domain),
                     allowed_recompute=MENU_NAMES)
    tokens = domain * 4096
    batcher = GlobalBatcher(tokens_per_step=tokens, max_seq_len=tokens, overlong="split")
    batch = next(itertools.islice(batcher.batches(enumerate(iter_builtin_lengths(mix, seed))), 0, None))
    return cost, np.array([i for i, _ in batch.sequences]), np.array([n for _, n in batch.sequences]), batch.max_length


@pytest.mark.parametrize("domain, mix", [(64, "wikipedia"), (256, "bytescale"), (256, "lognormal"), (512, "prolong"),
                                         (1024, "wikipedia")])
@pytest.mark.parametrize("planner", [megatron_dynamic.plan_megatron_dynamic, hybrid.plan_megatron_hybrid])
def test_an_early_stop_drops_exactly_the_plans_that_cannot_beat_must_beat(domain, mix, planner):
    # each seed drops its plan when it ends at or after must_beat; stopping early must not change which
    cost, ids, lengths, longest = _h200_batch(domain, mix, 0)
    whole = planner(ids, lengths, cost, max_seq_len=longest)
    makespan = plan_makespan(StepPlan(domain_size=domain, waves=whole))
    for factor in (0.2, 0.5, 0.9, 0.999, 1.0, 1.001, 1.5):
        got = planner(ids, lengths, cost, max_seq_len=longest, must_beat=makespan * factor)
        if makespan >= makespan * factor * (1 + 1e-9):
            assert got is None, factor
        else:
            assert got == whole, factor


@pytest.mark.parametrize("planner, lengths", [(megatron_dynamic.plan_megatron_dynamic, [100_000, 1_000]),
                                             (hybrid.plan_megatron_hybrid, [100_000])])
def test_an_early_stop_counts_on_the_growth_of_a_group_with_free_ranks_beside_it(planner, lengths, monkeypatch):
    # a long document on 64 ranks: its group starts at 8 ranks and grows into the free ones (megatron-dynamic's
    # fill-up, hybrid's buddy doubling), so its time before growing is no bound (checked from the first placement)
    monkeypatch.setattr(megatron_dynamic, "FIRST_CHECK", 1)
    # CP up to 32 of the 64 ranks: no full-domain rebuild, whose bound would hide the growth's
    cluster = dataclasses.replace(cluster_preset("h200", domain_size=64), max_cp_size=32)
    cost = CostModel(model_preset("llama3-8b"), cluster, allowed_recompute=MENU_NAMES)
    lengths = np.array(lengths)
    ids = np.arange(lengths.size)
    whole = planner(ids, lengths, cost, max_seq_len=100_000)
    assert max(g.size for w in whole for g in w.groups) > 8            # it grew
    makespan = plan_makespan(StepPlan(domain_size=64, waves=whole))
    assert planner(ids, lengths, cost, max_seq_len=100_000, must_beat=makespan * 1.001) == whole
    assert planner(ids, lengths, cost, max_seq_len=100_000, must_beat=makespan * 0.999) is None


def test_the_early_stop_ends_the_schedule_inside_a_wave_it_cannot_win(monkeypatch):
    # D=1,024 Wikipedia-like: one wave holds every sequence and its longest document's group alone outlasts dcp's
    # step several times, so the scheduler stops after its first check, long before it places every sequence
    cost, ids, lengths, longest = _h200_batch(1024, "wikipedia", 0)
    placed = []
    unfinished = dynamic_stop.EndsTooLate.unfinished

    def counted(self, groups, *args):
        placed.append(sum(len(m) for _, m in groups))
        return unfinished(self, groups, *args)
    monkeypatch.setattr(dynamic_stop.EndsTooLate, "unfinished", counted)
    dcp = make_plan("dcp", list(zip(ids.tolist(), lengths.tolist())), cost, max_seq_len=longest)
    assert megatron_dynamic.plan_megatron_dynamic(ids, lengths, cost, max_seq_len=longest,
                                                  must_beat=dcp.est_step_time_s) is None
    assert placed and placed[-1] < lengths.size / 4


def test_the_stop_is_asked_often_enough_to_end_a_wave_it_can_only_prove_late(monkeypatch):
    # bench_planner's p99 batch at D=1,024 (4M Wikipedia-like tokens, batch 15): the proof needs ~3,000 of the 4,004
    # placements (ranks stay free to grow into until then); asked only at each doubling (2,048, then the end) the
    # scheduler placed every sequence before losing: 31 of the plan's 51 ms
    cost = CostModel(model_preset("llama3-8b"), cluster_preset("h200", domain_size=1024), allowed_recompute=MENU_NAMES)
    batcher = GlobalBatcher(tokens_per_step=4_194_304, max_seq_len=4_194_304, overlong="split")
    batch = next(itertools.islice(batcher.batches(enumerate(iter_builtin_lengths("wikipedia", 0))), 15, None))
    ids, lengths = np.array([i for i, _ in batch.sequences]), np.array([n for _, n in batch.sequences])
    answers = []
    unfinished = dynamic_stop.EndsTooLate.unfinished

    def recorded(self, groups, *args):
        answers.append((sum(len(m) for _, m in groups), unfinished(self, groups, *args)))
        return answers[-1][1]
    monkeypatch.setattr(dynamic_stop.EndsTooLate, "unfinished", recorded)
    dcp = make_plan("dcp", batch.sequences, cost, max_seq_len=batch.max_length)
    assert megatron_dynamic.plan_megatron_dynamic(ids, lengths, cost, max_seq_len=batch.max_length,
                                                  must_beat=dcp.est_step_time_s) is None
    placed, stopped = answers[-1]
    assert stopped and placed < lengths.size, answers     # it stopped inside the schedule, before the last placement


def test_hybrid_stops_before_bucketing_the_short_sequences_when_the_longest_bucket_cannot_win(monkeypatch):
    # D=1,024 Wikipedia-like: the longest document's bucket (CP 4, first made) cannot double (no free buddy block)
    # and alone outlasts dcp's step: the CP-1 class, thousands of sequences, is never bucketed
    cost, ids, lengths, longest = _h200_batch(1024, "wikipedia", 0)
    bucketed = []
    buckets = hybrid._equal_work_buckets

    def counted(order, *args):
        bucketed.append(order.size)
        return buckets(order, *args)
    monkeypatch.setattr(hybrid, "_equal_work_buckets", counted)
    dcp = make_plan("dcp", list(zip(ids.tolist(), lengths.tolist())), cost, max_seq_len=longest)
    bucketed.clear()
    assert hybrid.plan_megatron_hybrid(ids, lengths, cost, max_seq_len=longest,
                                       must_beat=dcp.est_step_time_s) is None
    assert bucketed and sum(bucketed) < lengths.size / 4
