"""An out-of-memory in a planned micro-batch (core/out_of_memory.py, core/collective_watch.py): which micro-batch it
was, the record beside the checkpoints, the planner's budget under it, and the one line each rank ends with.
The end-to-end run (stopped, resumed, its trace) is tests/integration/test_megatron_loop.py."""
from __future__ import annotations

import json
import os

import pytest
import torch

from dcp_megatron.config import DcpConfig
from dcp_megatron.core import out_of_memory as oom
from dcp_megatron.core.collective_watch import CollectiveWatch
from dcp_megatron.core.planning import build_cost_model, plan_global_batch
from dcp_megatron.planner.costmodel import ModelShape

SHAPE = ModelShape(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, ffn_hidden_size=128,
                   vocab_size=256, transformer_impl="local", sequence_parallel=False)
LENGTHS = [1024, 900, 700, 512, 300, 200, 120, 60]


def _event(**changes) -> oom.OutOfMemory:
    fields = dict(iteration=3, rank=1, microbatch_index=2, num_tokens=1536, cp_size=2, relief="mlp",
                  counted_bytes=3 << 20, budget_bytes=4 << 20, peak_bytes=None)
    return oom.OutOfMemory(**{**fields, **changes})


def test_tracked_batches_name_the_running_micro_batch_and_the_hook_raises_at_its_index():
    tracked = oom.TrackedBatches(["a", "b", "c"])
    first, second = iter(tracked), iter(tracked)   # virtual pipeline stages: one iterator per model chunk
    assert next(first) == "a" and tracked.started == 0
    assert next(first) == "b" and next(second) == "a" and tracked.started == 1   # the furthest taken
    assert len(tracked) == 3 and tracked[2] == "c"
    injected = oom.TrackedBatches(["a", "b", "c"], inject_at=1)
    taken = []
    with pytest.raises(torch.OutOfMemoryError, match="micro-batch 1"):
        for batch in injected:
            taken.append(batch)
    assert taken == ["a"] and injected.started == 1


def test_the_injection_flag_names_one_iteration_and_rank():
    """--dcp-inject-out-of-memory-at ITERATION:RANK:MICROBATCH reaches the step loop as DcpConfig's field."""
    import argparse

    from dcp_megatron.config import DcpUsageError
    from dcp_megatron.flags.dcp_flags import add_dcp_arguments, dcp_flag_settings

    parser = add_dcp_arguments(argparse.ArgumentParser())
    at = dcp_flag_settings(parser.parse_args(["--dcp-inject-out-of-memory-at", "3:1:2"]))["inject_out_of_memory_at"]
    assert at == (3, 1, 2)
    assert oom.injected_microbatch(3, 1, at) == 2
    assert oom.injected_microbatch(3, 0, at) is None and oom.injected_microbatch(2, 1, at) is None
    for bad in ("3-1", "0:0:0"):
        with pytest.raises(DcpUsageError, match=f"--dcp-inject-out-of-memory-at {bad}: "):
            dcp_flag_settings(parser.parse_args(["--dcp-inject-out-of-memory-at", bad]))
    assert dcp_flag_settings(parser.parse_args([]))["inject_out_of_memory_at"] is None
    assert oom.injected_microbatch(3, 1, None) is None


def test_records_beside_the_checkpoints_give_the_smallest_count(tmp_path):
    assert oom.recorded(str(tmp_path), None) == [] and oom.limit_bytes([]) is None
    first = oom.record(str(tmp_path), _event())
    oom.record(str(tmp_path), _event(rank=0, counted_bytes=2 << 20))
    assert os.path.basename(first) == "iteration3-rank1-0.json"
    # a restarted run failing at the same step adds its own record beside the first
    assert os.path.basename(oom.record(str(tmp_path), _event(run="torchrun x restart 1"))) == "iteration3-rank1-1.json"
    assert not [p for p in os.listdir(tmp_path / oom.LIMIT_DIR) if ".tmp" in p]
    # the same directory given as --load and --save counts once
    events = oom.recorded(str(tmp_path), str(tmp_path))
    assert sorted(e.counted_bytes for e in events) == [2 << 20, 3 << 20, 3 << 20]
    assert oom.limit_bytes(events) == 2 << 20
    (tmp_path / oom.LIMIT_DIR / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="not an out-of-memory record"):
        oom.recorded(str(tmp_path))


def test_a_recorded_limit_caps_the_budget_and_the_plan_keeps_below_it(tmp_path):
    config = DcpConfig(seq_length=1024, memory_budget_gb=0.004)
    cost = build_cost_model(config, SHAPE, domain_size=2, has_gpu=False)
    plan = plan_global_batch(config, list(enumerate(LENGTHS)), cost)
    highest = max(mb.est_mem_bytes for wave in plan.waves for g in wave.groups for mb in g.microbatches)
    oom.record(str(tmp_path), _event(counted_bytes=highest))
    limited, note = oom.under_recorded_limit(config, str(tmp_path))
    assert limited.memory_limit_bytes == highest and "1 out-of-memory record(s)" in note
    assert oom.under_recorded_limit(config, str(tmp_path / "elsewhere")) == (config, None)
    capped = build_cost_model(limited, SHAPE, domain_size=2, has_gpu=False)
    assert capped.cluster.mem_budget_bytes <= oom.LIMIT_HEADROOM * highest < cost.cluster.mem_budget_bytes
    replanned = plan_global_batch(limited, list(enumerate(LENGTHS)), capped)
    counts = [mb.est_mem_bytes for wave in replanned.waves for g in wave.groups for mb in g.microbatches]
    assert max(counts) <= oom.LIMIT_HEADROOM * highest
    assert sorted(replanned.sequences()) == sorted(plan.sequences())   # every token still trained
    # a cap below the preset's own memory applies without --dcp-memory-budget-gb too
    assert oom.capped_memory_bytes(100, safety_frac=0.1, limit=None) == 100
    assert oom.capped_memory_bytes(10_000, safety_frac=0.1, limit=900) == int(0.95 * 900 / 0.9)


class _Store:
    def __init__(self):
        self.values = {}

    def set(self, key, value):
        self.values[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.values[key]

    def check(self, keys):
        return all(k in self.values for k in keys)


def _watch(store, rank):
    from dcp_megatron.runtime.heartbeat import Heartbeat

    watch = CollectiveWatch(rank=rank, world_size=2, step_of=lambda: 3, timeout_minutes=1)
    watch.heartbeat = Heartbeat(store, rank=rank, world_size=2, step_of=lambda: 3)
    return watch


def test_the_rank_that_ran_out_stops_records_and_posts_and_its_peers_name_it(tmp_path, capsys):
    store = _Store()
    event = _event()
    with pytest.raises(SystemExit) as stopped:
        _watch(store, 1).stop_on_out_of_memory(oom.MicrobatchOutOfMemory(event), save_dir=str(tmp_path),
                                               prefix="dcp: error: ")
    assert stopped.value.code == 1
    line = capsys.readouterr().err.strip()
    assert line.startswith("dcp: error: rank 1, iteration 3: out of memory in micro-batch 2 (1536 tokens, CP 2, "
                           "relief mlp): counted 0.003 GiB (memory factor x1.00) of a 0.004 GiB budget, not measured (no GPU)")
    assert "nothing saved" in line and "iteration3-rank1-0.json" in line and "\n" not in line
    assert oom.recorded(str(tmp_path)) == [event]
    # a peer whose collective timed out waiting for it names it, not a silent rank
    with pytest.raises(SystemExit):
        _watch(store, 0).stop_on_timeout(RuntimeError("Timed out waiting 60000ms"), where="iteration 3",
                                         prefix="dcp: error: ")
    peer = capsys.readouterr().err
    assert "rank 0, iteration 3: stopped waiting for a collective; rank 1, iteration 3: out of memory" in peer
    # without --save: said, nothing written
    with pytest.raises(SystemExit):
        _watch(_Store(), 1).stop_on_out_of_memory(oom.MicrobatchOutOfMemory(event), save_dir=None, prefix="")
    assert "not recorded (no --save)" in capsys.readouterr().err


def test_describe_reads_the_plans_count_for_the_running_micro_batch():
    from dcp_megatron.core.microbatch_facts import MICROBATCH_KEY

    config = DcpConfig(seq_length=1024, memory_budget_gb=0.004)
    cost = build_cost_model(config, SHAPE, domain_size=2, has_gpu=False)
    plan = plan_global_batch(config, list(enumerate(LENGTHS)), cost)
    schedule = [(mb, group.size) for _, group in plan.rank_schedule(1) for mb in group.microbatches]
    facts = [type("Facts", (), {"cp_size": size})() for _, size in schedule]
    tracked = oom.TrackedBatches([{MICROBATCH_KEY: f} for f in facts])
    for _ in zip(range(len(schedule)), tracked):
        pass
    event = oom.describe(plan, tracked, iteration=4, rank=1, domain_rank=1, budget_bytes=7, static_bytes=5)
    last, size = schedule[-1]
    assert (event.microbatch_index, event.num_tokens, event.cp_size, event.relief, event.counted_bytes) == (
        len(schedule) - 1, last.num_tokens, size, str(last.recompute), last.est_mem_bytes)
    assert json.loads(event.to_json())["budget_bytes"] == 7


def test_records_keep_their_units_and_an_emulated_devices_overrun_lowers_the_limit_further(tmp_path):
    """The memory factor in force is kept beside the count (a resumed run's count starts at it), the run that wrote
    each record is named, and an emulated device's overrun (live bytes past it) scales the limit down with it."""
    plain = _event(counted_bytes=3 << 20)
    assert plain.limit() == 3 << 20
    overrun = _event(counted_bytes=3 << 20, device_bytes=2 << 20, attempted_bytes=4 << 20, memory_factor=1.5,
                     run="torchrun r restart 0")
    assert overrun.limit() == (3 << 20) // 2 and "(memory factor x1.50)" in overrun.line()
    assert "4.0000" not in overrun.line() and "live past the 0.0020 GiB device" in overrun.line()
    elsewhere = _event(phase=oom.OPTIMIZER, counted_bytes=0)
    assert elsewhere.limit() is None and oom.limit_bytes([elsewhere]) is None
    assert oom.limit_bytes([plain, overrun, elsewhere]) == (3 << 20) // 2
    for event in (overrun, elsewhere):
        oom.record(str(tmp_path), event)
    config = DcpConfig(seq_length=1024, memory_budget_gb=0.004)
    limited, note = oom.under_recorded_limit(config, str(tmp_path))
    assert limited.memory_limit_bytes == (3 << 20) // 2
    assert limited.recorded_memory_factors == (("mlp", 1.5),)
    assert "written by torchrun r restart 0" in note and "mlp x1.50" in note
    assert oom.OutOfMemory.from_json(overrun.to_json()) == overrun


def test_the_loop_counts_in_the_recorded_units():
    """A resumed run's loop starts its memory count at the recorded factors: the plans' counts carry them."""
    from dcp_megatron.core.step_loop import PlannedStepLoop

    config = DcpConfig(seq_length=1024, memory_budget_gb=0.008, recorded_memory_factors=(("none", 1.5),),
                       plan_ahead=False)
    cost = build_cost_model(config, SHAPE, domain_size=2, has_gpu=False)
    pool = type("Pool", (), {"domain_rank": 0, "domain_size": 1})()
    loop = PlannedStepLoop(config=config, pool=pool, cost=cost, device="cpu", is_logging_rank=False)
    assert loop.memory_scale.of("none") == 1.5 and loop.cost.memory_scale.of("none") == 1.5
    assert loop.base_cost.memory_scale.is_identity


def test_runs_that_keep_running_out_at_one_step_stop_at_start(tmp_path):
    from dcp_megatron.config import DcpUsageError

    events = [_event(run=f"torchrun r restart {n}", rank=n % 2) for n in range(oom.MAX_EVENTS_PER_STEP - 1)]
    events += [_event(run="torchrun r restart 0", rank=1)]   # two ranks of one run count once
    oom.check_retries(events)
    events.append(_event(run="torchrun r restart 9", iteration=4))   # another step
    oom.check_retries(events)
    events.append(_event(run="torchrun r restart 9"))
    with pytest.raises(DcpUsageError, match=f"{oom.MAX_EVENTS_PER_STEP} runs ran out of memory at iteration 3"):
        oom.check_retries(events)


def _raise_in(path: str, name: str):
    code = compile(f"def {name}():\n    raise torch.OutOfMemoryError('x')\n", path, "exec")
    scope = {"torch": torch}
    exec(code, scope)
    try:
        scope[name]()
    except torch.OutOfMemoryError as err:
        return err


@pytest.mark.parametrize("path, name, phase", [
    ("/x/site-packages/torch/optim/adam.py", "adam", oom.OPTIMIZER),
    ("/x/site-packages/megatron/core/optimizer/optimizer.py", "step", oom.OPTIMIZER),
    ("/x/site-packages/deepspeed/runtime/engine.py", "_take_model_step", oom.OPTIMIZER),
    ("/x/site-packages/megatron/training/training.py", "evaluate", oom.EVALUATION),
    ("/x/dcp_megatron/deepspeed/evaluation.py", "evaluate", oom.EVALUATION),
    ("/x/dcp_megatron/training/memory_probe_run.py", "_run_once", oom.PROBE),
    ("/x/site-packages/megatron/core/transformer/mlp.py", "forward", oom.MICROBATCH),
])
def test_an_out_of_memory_is_named_by_where_it_was_raised(path, name, phase):
    err = _raise_in(path, name)
    assert oom.phase_of(err) == phase
    event = oom.outside_microbatch(err, iteration=2, rank=0)
    if phase != oom.MICROBATCH:
        assert f"out of memory in the {phase}" in event.line() and oom.ADVICE[phase] in event.line()
        assert "budget" not in event.line().split(":")[1]
