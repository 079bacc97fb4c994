"""GroupPool: the right members in every group, one global creation order, lazily created blocks,
several domains side by side, the configured timeout, and clear errors for bad domains. Split planning
(core/split_planning.py): each rank plans its own part and gathers the others' into the one-process plan; ranks
of a part that disagree stop every rank at the plan hash check.

One 4-rank gloo launch runs every case (launches are import-bound on this machine).
"""
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dcp_megatron.planner.plan import Group, MicroBatch, StepPlan, Wave
from dcp_megatron.runtime.group_pool import GroupPool, aligned_power_of_two_blocks, plan_blocks
from tests.support.dist_utils import run_distributed

TIMEOUT = timedelta(seconds=30)


def test_aligned_power_of_two_blocks():
    assert aligned_power_of_two_blocks(1) == []
    assert aligned_power_of_two_blocks(3) == [(0, 2)]
    assert aligned_power_of_two_blocks(4) == [(0, 2), (2, 2), (0, 4)]
    assert aligned_power_of_two_blocks(6) == [(0, 2), (2, 2), (4, 2), (0, 4)]
    assert len(aligned_power_of_two_blocks(8)) == 4 + 2 + 1


def test_plan_blocks_ignores_single_rank_groups():
    mb = MicroBatch(((0, 5),))
    plan = StepPlan(domain_size=4, waves=(
        Wave((Group(0, 1, (mb,)), Group(1, 3, (mb,)))),
        Wave((Group(0, 2, (mb,)), Group(2, 2, ()))),
    ))
    assert plan_blocks(plan) == {(1, 3), (0, 2), (2, 2)}


def _block_sum(pool: GroupPool, first: int, size: int) -> float:
    """All-reduce of (global rank + 1) over the block's group: which global ranks are in it."""
    value = torch.tensor([float(dist.get_rank() + 1)])
    group = pool.group(first, size)
    if group is not None:
        assert dist.get_world_size(group) == size
        assert dist.get_rank(group) == pool.domain_rank - first  # group rank = position in the block
        dist.all_reduce(value, group=group)
    return float(value)


def _raises(fn) -> str:
    try:
        fn()
    except ValueError as err:
        return str(err)
    raise AssertionError("expected ValueError")


def _pool_worker(rank: int, world_size: int) -> dict:
    out: dict = {}
    # One domain of 4: aligned power-of-two blocks exist from the start.
    pool = GroupPool([[0, 1, 2, 3]], timeout=TIMEOUT)
    out["startup"] = sorted(pool.created_blocks)
    out["pow2_sums"] = {b: _block_sum(pool, *b) for b in sorted(pool.created_blocks)
                        if b[0] <= rank < b[0] + b[1]}
    out["single"] = pool.group(rank, 1)
    # Non-aligned blocks are created on first use; every rank asks for the same ones.
    out["new_count"] = pool.ensure_groups([(1, 3), (0, 3), (1, 2), (0, 2), (3, 1)])
    out["again_count"] = pool.ensure_groups([(1, 3), (0, 3)])
    out["lazy_sums"] = {b: _block_sum(pool, *b) for b in [(1, 3), (0, 3), (1, 2)] if b[0] <= rank < b[0] + b[1]}
    out["not_member"] = _raises(lambda: pool.group(0, 1) if rank != 0 else pool.group(1, 1))
    out["outside"] = _raises(lambda: pool.group(2, 3))
    # A cap on lazily created blocks: past it the least recently used one the step does not need is destroyed.
    capped = GroupPool([[0, 1, 2, 3]], timeout=TIMEOUT, max_odd_blocks=1)
    history = []
    for blocks in ([(1, 2)], [(0, 3)], [(1, 2)], [(1, 2)]):
        new = capped.ensure_groups(blocks)
        history.append((new, sorted(capped.created_blocks), {b: _block_sum(capped, *b) for b in blocks
                                                               if b[0] <= rank < b[0] + b[1]}))
    out["capped"] = history
    # Two domains (DP x CP of two TP coordinates): contiguous and strided.
    for name, domains in (("contiguous", [[0, 1], [2, 3]]), ("strided", [[0, 2], [1, 3]])):
        pool2 = GroupPool(domains, timeout=TIMEOUT)
        value = torch.tensor([float(rank + 1)])
        dist.all_reduce(value, group=pool2.domain_group)
        out[name] = (pool2.domain_rank, pool2.domain_size, pool2.domain_ranks, float(value))
    # Bad domains are rejected before any group is created (so no rank is left waiting).
    out["errors"] = [
        _raises(lambda: GroupPool([[0, 1], [1, 2, 3]], timeout=TIMEOUT)),
        _raises(lambda: GroupPool([[0, 1, 2], [2, 3, 4]], timeout=TIMEOUT)),
        _raises(lambda: GroupPool([[1, 0], [2, 3]], timeout=TIMEOUT)),
        _raises(lambda: GroupPool([[0, 1, 2, 9]], timeout=TIMEOUT)),
        _raises(lambda: GroupPool([[0, 1]] if rank >= 2 else [[2, 3]], timeout=TIMEOUT)),
        _raises(lambda: GroupPool([[0, 1, 2, 3]], timeout=timedelta(0))),
    ]
    out["split"] = _split_cases(rank)
    # Every group gets the pool's timeout: a peer that never arrives fails the collective in ~1 s.
    short = GroupPool([[0, 1], [2, 3]], timeout=timedelta(seconds=1))
    if rank == 1:
        try:
            dist.all_reduce(torch.ones(1), group=short.domain_group)
            out["timeout"] = "completed"
        except RuntimeError as err:
            out["timeout"] = str(err)
    # Split planning where part 1's ranks plan the batch whole (another flag): part 0's gather times out, named.
    from dcp_megatron.core.split_planning import SplitPlanner, planning_groups
    group = planning_groups([[0, 1, 2, 3]], timeout=timedelta(seconds=1))
    if rank < 2:
        planner = SplitPlanner(policy="dcp", max_seq_len=4096, part_ranks=2, domain_rank=rank, group=group)
        try:
            planner(_split_batch(), _split_cost())
            out["split_timeout"] = "completed"
        except RuntimeError as err:
            out["split_timeout"] = str(err)
    return out


def _split_batch():
    lengths = [300, 2500, 90, 1200, 700, 40, 3000, 800, 150, 60, 1900, 420]
    return list(enumerate(lengths))


def _split_cost(time_scale=None):
    from tests.support.planner_helpers import tiny_cost
    cost = tiny_cost(4, gpus_per_node=2)
    return cost.with_time_scale(time_scale) if time_scale else cost


def _split_cases(rank: int) -> dict:
    from dcp_megatron.core.planning import check_same_plan
    from dcp_megatron.core.split_planning import SplitPlanner, planning_groups

    group = planning_groups([[0, 1, 2, 3]], timeout=TIMEOUT)
    planner = SplitPlanner(policy="dcp", max_seq_len=4096, part_ranks=2, domain_rank=rank, group=group)
    out = {"plan": planner(_split_batch(), _split_cost()).dumps()}
    # the step loop's own plan function: split with --dcp-plan-part-ranks 2, whole with 0
    from dcp_megatron.config import DcpConfig
    from dcp_megatron.core.step_loop import PlannedStepLoop
    pool = GroupPool([[0, 1, 2, 3]], timeout=TIMEOUT)
    out["loop"] = [PlannedStepLoop._default_plan_function(DcpConfig(seq_length=4096, plan_part_ranks=part), pool)(
        _split_batch(), _split_cost()).dumps() for part in (2, 0)]
    # rank 3 plans part 1 with another cost model than rank 2 (as a rank started with other flags would)
    other = _split_cost({(1, "none"): 3.0}) if rank == 3 else _split_cost()
    plan = planner(_split_batch(), other)
    try:
        check_same_plan(plan, iteration=7, group=None, device="cpu")
        out["mismatch"] = "no error"
    except RuntimeError as err:
        out["mismatch"] = str(err)
    return out


@pytest.fixture(scope="module")
def pool_results():
    return run_distributed(_pool_worker, 4, timeout_s=300)


def test_startup_blocks_and_members(pool_results):
    for rank, out in enumerate(pool_results):
        assert out["startup"] == [(0, 2), (0, 4), (2, 2)]
        expected = {(0, 2): 3.0, (2, 2): 7.0, (0, 4): 10.0}
        assert out["pow2_sums"] == {b: s for b, s in expected.items() if b[0] <= rank < b[0] + b[1]}
        assert out["single"] is None


def test_lazy_blocks_created_once_with_the_right_members(pool_results):
    for rank, out in enumerate(pool_results):
        assert out["new_count"] == 3          # (1,3), (0,3), (1,2); (0,2) existed; size 1 needs none
        assert out["again_count"] == 0
        expected = {(1, 3): 2 + 3 + 4.0, (0, 3): 1 + 2 + 3.0, (1, 2): 2 + 3.0}
        assert out["lazy_sums"] == {b: s for b, s in expected.items() if b[0] <= rank < b[0] + b[1]}
        assert "is not in block" in out["not_member"]
        assert "outside the domain" in out["outside"]


def test_lazy_blocks_beyond_the_cap_are_destroyed_least_recently_used_first(pool_results):
    startup = [(0, 2), (0, 4), (2, 2)]
    for rank, out in enumerate(pool_results):
        sums = [{b: s for b, s in step.items() if b[0] <= rank < b[0] + b[1]}
                for step in ({(1, 2): 5.0}, {(0, 3): 6.0}, {(1, 2): 5.0}, {(1, 2): 5.0})]
        assert out["capped"] == [
            (1, sorted(startup + [(1, 2)]), sums[0]),
            (1, sorted(startup + [(0, 3)]), sums[1]),    # (1, 2) destroyed: the cap is 1
            (1, sorted(startup + [(1, 2)]), sums[2]),    # made again on its next use, (0, 3) destroyed
            (0, sorted(startup + [(1, 2)]), sums[3]),    # in use: kept, nothing created
        ]


def test_several_domains(pool_results):
    for rank, out in enumerate(pool_results):
        assert out["contiguous"] == (rank % 2, 2, [rank - rank % 2, rank - rank % 2 + 1],
                                     float((rank - rank % 2 + 1) + (rank - rank % 2 + 2)))
        assert out["strided"] == (rank // 2, 2, [rank % 2, rank % 2 + 2], float((rank % 2 + 1) + (rank % 2 + 3)))


def test_bad_domains_are_named(pool_results):
    overlap, sizes, order, range_, missing, timeout = pool_results[0]["errors"]
    assert "same size" in overlap           # checked first: [0,1] vs [1,2,3]
    assert "disjoint" in sizes and "2" in sizes
    assert "increasing order" in order and "[1, 0]" in order
    assert "[9]" in range_ and "outside the world" in range_
    assert "exactly one domain" in missing
    assert "positive timedelta" in timeout


def test_groups_use_the_pool_timeout(pool_results):
    message = pool_results[1]["timeout"]
    assert message != "completed"
    assert "imed out" in message or "timeout" in message.lower()


def test_split_planning_gathers_the_one_process_plan(pool_results):
    from dcp_megatron.planner.policies import make_plan
    expected = make_plan("dcp", _split_batch(), _split_cost(), max_seq_len=4096, part_ranks=2)
    assert expected.extra["split"]["parts"] == 2          # the split path, not a whole plan
    assert [r["split"]["plan"] for r in pool_results] == [expected.dumps()] * 4
    whole = make_plan("dcp", _split_batch(), _split_cost(), max_seq_len=4096)
    assert "split" not in whole.extra
    assert [r["split"]["loop"] for r in pool_results] == [[expected.dumps(), whole.dumps()]] * 4


def test_ranks_of_a_part_that_disagree_stop_every_rank(pool_results):
    for r in pool_results:
        assert r["split"]["mismatch"].startswith("iteration 7: ranks computed different plans"), r["split"]


def test_a_part_whose_peers_plan_whole_times_out_with_a_message(pool_results):
    for rank in (0, 1):
        message = pool_results[rank]["split_timeout"]
        assert message.startswith(f"split planning: domain rank {rank} (part 0 of 2, 2 ranks each) could not gather"), \
            message
