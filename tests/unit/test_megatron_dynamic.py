"""`megatron-dynamic` (Megatron dev's dynamic-CP scheduler) on small cases worked out by hand.

Worked cases use `schedule_groups(lengths, sizes, D, cap)`: per micro-batch, its groups as
(CP size, indices into lengths). A sequence's per-rank share at size s is 2·ceil(L / 2s); its
workload L²/s; the busiest-rank bound 1.05 · longest · cap.
"""
import numpy as np
import pytest

from dcp_megatron.planner.policies import make_plan
from dcp_megatron.planner.baselines.megatron_dynamic import dynamic_cp_sizes, schedule_groups
from dcp_megatron.planner.dcp import search
from dcp_megatron.planner.validate import validate
from tests.support.dynamic_scan_reference import schedule_groups_by_scan
from tests.support.planner_helpers import tiny_cost
from tests.support.tool_helpers import load_tool
from tests.unit.test_planner_policies import long_tailed_batch


def test_allowed_sizes_are_powers_of_two_dividing_the_domain_and_the_domain():
    assert dynamic_cp_sizes(8, 8) == [1, 2, 4, 8]
    assert dynamic_cp_sizes(6, 6) == [1, 2, 6]          # 4 does not divide 6
    assert dynamic_cp_sizes(12, 12) == [1, 2, 4, 12]
    assert dynamic_cp_sizes(8, 4) == [1, 2, 4]          # the cluster's CP cap


def test_packing_aware_placement_joins_groups_with_room_and_opens_new_ones():
    # D=4, cap 100, bound 1.05*150*100 = 15750. 150 needs size 2 (share 76, work 11250).
    # 80: a new size-1 group keeps the busiest at 11250 (size 2 has no room: 76+40 > 100).
    # 60: group {80} is full (140 > 100) -> a new size-1 group. 40: joins {60} (share 40, 60+40 = 100),
    # busiest stays 11250, better than joining {150} at size 2 (11250+800). 30: no size-1 room
    # (110, 130) -> joins {150} at size 2 (76+16 = 92 <= 100; busiest 11700 <= 15750).
    groups = schedule_groups([150, 80, 60, 40, 30], [1, 2, 4], 4, 100)
    assert groups == [[(2, [0, 4]), (1, [1]), (1, [2, 3])]]


def test_free_ranks_are_filled_by_growing_the_smallest_group():
    # 150 alone takes size 2; two ranks stay free -> it grows to 4.
    assert schedule_groups([150], [1, 2, 4], 4, 100) == [[(4, [0])]]
    # 150 at size 2, 90 at size 1; one free rank -> the size-1 group grows to 2.
    assert schedule_groups([150, 90], [1, 2, 4], 4, 100) == [[(2, [0]), (2, [1])]]


def test_a_sequence_over_the_workload_bound_waits_for_the_next_microbatch():
    # D=2, cap 100, bound 10500: two 100-token sequences fill both ranks; the third fits no
    # group and no free rank, so it starts micro-batch 2 alone, which then grows to size 2.
    assert schedule_groups([100, 100, 100], [1, 2], 2, 100) == [[(1, [0]), (1, [1])], [(2, [2])]]


def test_non_power_of_two_domain_falls_back_to_one_full_domain_group():
    # D=6, sizes 1, 2, 6: two 150s take size 2 each (4 ranks); growing a size-2 group to 6 does
    # not fit, so the micro-batch is rebuilt as one group of 6 (shares 26 + 26 <= 100).
    assert schedule_groups([150, 150], [1, 2, 6], 6, 100) == [[(6, [0, 1])]]
    # the full group takes what fits in order; the rest waits: shares 2*ceil(500/12) = 84 each
    assert schedule_groups([500, 500], [1, 2, 6], 6, 100) == [[(6, [0])], [(6, [1])]]


def test_a_sequence_that_fits_no_allowed_size_is_refused():
    with pytest.raises(ValueError, match="fits no CP size"):
        schedule_groups([500], [1, 2, 4], 4, 100)


@pytest.mark.parametrize("domain_size, pp", [(8, 1), (8, 2), (6, 1)])
def test_plans_use_aligned_groups_one_microbatch_per_rank_per_wave_and_one_recompute(domain_size, pp):
    cost = tiny_cost(domain_size, pp=pp)
    batch = long_tailed_batch(1)
    plan = make_plan("megatron-dynamic", batch, cost, max_seq_len=24000)
    validate(plan, batch, cost.cluster, cost)
    assert plan.policy == "megatron-dynamic" and len(plan.waves) >= 2
    sizes = set(dynamic_cp_sizes(domain_size, domain_size))
    for wave in plan.waves:
        for group in wave.groups:
            assert group.size in sizes and group.first_rank % group.size == 0 or group.size == domain_size
            assert len(group.microbatches) == 1                 # every rank: one micro-batch per wave
    assert {str(mb.recompute) for w in plan.waves for g in w.groups for mb in g.microbatches
            if mb.sequences} == {str(plan.waves[0].groups[0].microbatches[0].recompute)}
    dcp = make_plan("dcp", batch, cost, max_seq_len=24000)
    assert dcp.est_step_time_s <= plan.est_step_time_s


@pytest.mark.parametrize("seed", range(2))
def test_the_blocked_group_search_schedules_exactly_as_a_scan_of_every_group(seed):
    # domains up to 512 ranks with many short sequences: hundreds of groups per size (several search blocks),
    # micro-batches that fill up (leftovers), ties of equal lengths, the least-workload path when nothing keeps
    # the busiest rank
    rng = np.random.default_rng(seed)
    for _ in range(20):
        domain = int(rng.choice([4, 6, 12, 64, 128, 256, 512]))
        sizes = dynamic_cp_sizes(domain, domain, int(rng.choice([1, 1, 2])))
        cap = int(rng.choice([64, 100, 1000]))
        count = int(rng.integers(1, 2 * domain))
        longest = cap * sizes[-1]
        if rng.random() < 0.3:
            lengths = rng.choice([10, 20, 40, 80], size=count)
        else:
            lengths = np.maximum(1, (longest * rng.random(count) ** rng.choice([1, 3, 8])).astype(np.int64))
        lengths = lengths.tolist()
        assert schedule_groups(lengths, sizes, domain, cap) == schedule_groups_by_scan(lengths, sizes, domain, cap)


def test_planner_stages_tool_times_every_stage(capsys):
    tool = load_tool("planner_stages")
    assert tool.main(["--gpus", "16", "--tokens-per-step", "65536", "--batches", "1"]) == 0
    out = capsys.readouterr().out
    for label in ("dcp own layout", "baseline layout: megatron-dynamic", "megatron-dynamic: scheduler"):
        assert label in out
    assert "CPU s per plan" in out.splitlines()[0]
    assert not hasattr(search.plan_dcp, "__wrapped__") and search.plan_dcp.__name__ == "plan_dcp"   # removed again
