"""The memory correction reaches the PLANS (core/step_loop.py), read from the plans themselves, not the log line:
the probe's factors (`calibrate_memory`) and the online factors (a step's readings, folded when the next starts)
make the next plan's micro-batches carry the corrected count (est_mem_bytes) and pack fewer tokens each; a short
micro-batch's fixed-cost reading does not move them (the noise guard). One process, a gloo world of 1, the planned
step loop with an engine that returns made-up readings (no model runs)."""
from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dcp_megatron.config import DcpConfig
from dcp_megatron.core.global_batch import Documents
from dcp_megatron.core.step_loop import PlannedStepLoop, RanBatches
from dcp_megatron.planner.costmodel import CostModel, ModelShape, cpu_cluster
from dcp_megatron.planner.costmodel.memory_correction import MemoryReading
from dcp_megatron.planner.costmodel.memory_spec import CPU_FP32
from dcp_megatron.planner.plan import NO_RECOMPUTE
from dcp_megatron.runtime.measured_memory import SAVED, counted_bytes

SEQ = 256
DOCS = [SEQ] * 6       # one step's documents
ROOM_TOKENS = 600      # tokens of the activation room at factor 1: two documents per micro-batch, one at factor 2
LOW = 2.0              # the count is this much low in the made-up readings


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    from dcp_megatron.runtime.group_pool import GroupPool

    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        yield GroupPool([[0]], timeout=timedelta(seconds=60))
    finally:
        dist.destroy_process_group()


def _cost() -> CostModel:
    shape = ModelShape(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=4, head_dim=16, ffn_hidden_size=128,
                       vocab_size=256, activations=CPU_FP32)
    probe = CostModel(shape, cpu_cluster(1), allowed_recompute=("none",))
    budget = (probe.static_bytes + ROOM_TOKENS * probe.bytes_per_local_token(NO_RECOMPUTE)) / 0.9
    return CostModel(shape, dataclasses.replace(cpu_cluster(1), mem_bytes_per_gpu=int(budget)),
                     allowed_recompute=("none",))


class _Engine:
    """Reads DOCS every step; runs nothing; reports each micro-batch's bytes as `low` x the count (+ `fixed`)."""

    def __init__(self, base_cost, *, low: float = LOW, fixed: float = 0.0) -> None:
        self.base_cost, self.low, self.fixed = base_cost, low, fixed
        self.plans: list = []

    def read_share(self, num_samples):
        rows = torch.zeros(sum(DOCS), 3, dtype=torch.int64)
        rows[:, 2] = 1
        return Documents(rows=rows, lengths=tuple(DOCS)), None

    def data_ended(self, iteration):
        raise AssertionError("the data does not end")

    def adapt_batches(self, batches):
        return batches

    def trace_target(self):
        return [], None

    def record(self, record):
        pass

    def run_batches(self, batches, share):
        plan = share.planned.plan
        self.plans.append(plan)
        ran = [(group, mb) for _, group in plan.rank_schedule(0) for mb in group.microbatches]
        memory = tuple(self.fixed + self.low * counted_bytes(self.base_cost, mb.lengths, group.size, mb.recompute,
                                                             SAVED) for group, mb in ran)
        return RanBatches(durations=tuple(0.01 for _ in ran), result=None, memory_bytes=memory)


def _loop(pool, cost):
    config = DcpConfig(seq_length=SEQ, plan_ahead=False, refine=False, recompute=("none",))
    return PlannedStepLoop(config=config, pool=pool, cost=cost, device=torch.device("cpu"), is_logging_rank=False,
                           measure_memory=True)


def _microbatches(plan):
    return [(group.size, mb) for wave in plan.waves for group in wave.groups for mb in group.microbatches
            if mb.sequences]


def _assert_packed_to(plan, cost, *, scaled_from=None):
    """Every micro-batch carries `cost`'s count (a corrected one when `scaled_from`, the base, counts less)."""
    for size, mb in _microbatches(plan):
        assert mb.est_mem_bytes == cost.microbatch_memory(mb.lengths, size, recompute=mb.recompute)
        if scaled_from is not None:
            assert mb.est_mem_bytes > scaled_from.microbatch_memory(mb.lengths, size, recompute=mb.recompute)
    return max(sum(mb.lengths) for _, mb in _microbatches(plan))


def test_the_probes_factors_pack_the_first_plan(pool):
    base = _cost()
    loop = _loop(pool, base)
    tokens = 2 * SEQ
    counted = counted_bytes(base, [SEQ, SEQ], 1, NO_RECOMPUTE, SAVED)
    loop.calibrate_memory([MemoryReading("none", counted_bytes=counted, measured_bytes=LOW * counted)], ["none"])
    assert loop.memory_scale.of("none") == pytest.approx(LOW * 1.05)
    engine = _Engine(base)
    loop.step(engine, iteration=1, num_samples=1, next_num_samples=None)
    # step 1's plan: packed to the corrected count, one document per micro-batch where the count fits two
    assert _assert_packed_to(engine.plans[0], loop.cost, scaled_from=base) == SEQ
    assert base.fits([SEQ, SEQ], 1) and not loop.cost.fits([SEQ, SEQ], 1) and tokens == 2 * SEQ
    loop.close()


def test_the_online_factors_pack_the_plans_after_the_step_that_measured(pool):
    base = _cost()
    loop = _loop(pool, base)
    engine = _Engine(base)
    loop.step(engine, iteration=1, num_samples=1, next_num_samples=None)
    assert _assert_packed_to(engine.plans[0], base) == 2 * SEQ          # as counted: two documents fit
    loop.step(engine, iteration=2, num_samples=1, next_num_samples=None)   # folds step 1's readings first
    assert loop.memory_scale.of("none") == pytest.approx(LOW * 1.05)
    assert _assert_packed_to(engine.plans[1], loop.cost, scaled_from=base) == SEQ
    loop.close()


def test_a_fixed_cost_reading_below_the_noise_floor_moves_no_plan(pool):
    """A probe reading of a tiny micro-batch (its fixed allocations 100x its count) is left out: the factor, the
    plans and the --seq-length check stay as counted."""
    base = _cost()
    loop = _loop(pool, base)
    tiny = counted_bytes(base, [2], 1, NO_RECOMPUTE, SAVED)
    loop.calibrate_memory([MemoryReading("none", counted_bytes=tiny, measured_bytes=100 * tiny)], ["none"])
    loop.check_longest_fits()
    assert loop.memory_scale.is_identity
    engine = _Engine(base, low=1.0)
    loop.step(engine, iteration=1, num_samples=1, next_num_samples=None)
    assert _assert_packed_to(engine.plans[0], base) == 2 * SEQ
    loop.close()
