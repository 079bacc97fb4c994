"""Megatron's schedule flags on the DeepSpeed engine (dcp_megatron/deepspeed/lr_schedule.py), one process.

A real DeepSpeed engine (one gloo rank, a tiny linear model) steps the scheduler the script hands it: the rate
of every update is the one Megatron's OptimizerParamScheduler gives in Megatron's loop for the same flags
(warm-up, cosine decay, min-lr), resume through DeepSpeed's checkpoint continues the step count, and the bad
combinations stop at start naming both settings. (The real script's logged rates: tests/integration/test_deepspeed.py.)
"""
from __future__ import annotations

import json
import math
import os

import pytest

from dcp_megatron.config import DcpUsageError
from tests.support.deepspeed_runs import TINY_MODEL
from tests.support.dist_utils import free_port

PEAK, MIN_LR, WARMUP, DECAY, ITERS = 3e-3, 3e-4, 2, 6, 8
SCHEDULE = ["--lr", str(PEAK), "--min-lr", str(MIN_LR), "--lr-decay-style", "cosine", "--lr-warmup-iters",
            str(WARMUP), "--lr-decay-iters", str(DECAY)]
GLOBAL_BATCH = int(TINY_MODEL[TINY_MODEL.index("--global-batch-size") + 1])


def _config(tmp_path, **extra) -> str:
    config = {"optimizer": {"type": "SGD", "params": {"lr": PEAK}}, "steps_per_print": 1000, **extra}
    path = tmp_path / f"ds_{len(list(tmp_path.glob('ds_*.json')))}.json"
    path.write_text(json.dumps(config))
    return str(path)


def _args(tmp_path, flags, **extra):
    from dcp_megatron.deepspeed.arguments import parse_args

    return parse_args([*TINY_MODEL, "--deepspeed-config", _config(tmp_path, **extra), "--train-iters", str(ITERS),
                       *flags])


def _schedule(tmp_path, flags=SCHEDULE, **extra):
    from dcp_megatron.deepspeed.config import load_deepspeed_config
    from dcp_megatron.deepspeed.lr_schedule import megatron_schedule

    args = _args(tmp_path, flags, **extra)
    return megatron_schedule(args, load_deepspeed_config(args.deepspeed_config))


def _megatron_rates(updates: int) -> list[float]:
    """The rate of each update in Megatron's loop: the scheduler sets it at step(0), then train_step steps it by
    one global batch of samples after every update."""
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=PEAK)
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=PEAK, min_lr=MIN_LR,
                                        lr_warmup_steps=WARMUP * GLOBAL_BATCH, lr_decay_steps=DECAY * GLOBAL_BATCH,
                                        lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                        wd_incr_steps=ITERS * GLOBAL_BATCH, wd_incr_style="constant")
    rates = []
    for _ in range(updates):
        rates.append(optimizer.param_groups[0]["lr"])
        scheduler.step(increment=GLOBAL_BATCH)
    return rates


@pytest.fixture(scope="module")
def one_rank():
    """torch.distributed with one gloo rank (DeepSpeed's engine needs a group), removed after the module."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import datetime

    import torch.distributed as dist

    from patches.sets import patch_set

    timeout = datetime.timedelta(minutes=2)
    registry = patch_set("deepspeed", timeout=timeout).apply()   # no shm op build at init
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", timeout=timeout)
    yield
    dist.destroy_process_group()
    registry.remove()
    for key, value in saved.items():
        os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)


def _engine(schedule, *, weight_decay=None):
    """The trainer's engine (its initialize_engine) over a tiny linear model, ZeRO-1."""
    import torch

    from dcp_megatron.deepspeed.setup import initialize_engine

    torch.manual_seed(0)
    params = {"lr": PEAK, **({} if weight_decay is None else {"weight_decay": weight_decay})}
    # ZeRO-1: DeepSpeed restores the optimizer partition (its param groups' saved rates) after the scheduler's state
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
              "optimizer": {"type": "SGD", "params": params}, "zero_optimization": {"stage": 1},
              "zero_allow_untested_optimizer": True}
    return initialize_engine(torch.nn.Linear(4, 4), config, schedule)


def _train(engine, updates: int) -> list[float]:
    """The rate each update ran at (the param group's before its step), as the script drives the engine."""
    import torch

    rates = []
    for _ in range(updates):
        rates.append(engine.get_lr()[0])
        engine.backward(engine(torch.ones(1, 4)).sum())
        engine.step()
    return rates


def test_each_update_runs_megatrons_rate(tmp_path, one_rank):
    schedule = _schedule(tmp_path)
    rates = _train(_engine(schedule, weight_decay=0.05), ITERS)
    expected = _megatron_rates(ITERS)
    assert rates == pytest.approx(expected, rel=1e-12, abs=0), (rates, expected)
    # by hand: linear warm-up from 0 over 2 updates, cosine to min-lr by update 7 (6 decay iterations), then min-lr
    cosine = [MIN_LR + (PEAK - MIN_LR) * 0.5 * (1 + math.cos(math.pi * (i - WARMUP) / (DECAY - WARMUP)))
              for i in range(WARMUP, DECAY + 1)]
    assert rates == pytest.approx([0.0, PEAK / 2, *cosine, MIN_LR], rel=1e-12, abs=0)


def test_resume_continues_the_step_count(tmp_path, one_rank):
    from dcp_megatron.deepspeed import checkpoint

    schedule = _schedule(tmp_path)
    engine = _engine(schedule, weight_decay=0.05)
    first = _train(engine, 3)
    checkpoint.save(engine, str(tmp_path / "ckpt"), iteration=3, data_state={}, ds_config={})
    resumed = _engine(_schedule(tmp_path), weight_decay=0.05)
    iteration, _ = checkpoint.load(resumed, str(tmp_path / "ckpt"), apply_config=False)
    assert iteration == 3 and resumed.lr_scheduler.state_dict()["num_steps"] == 3 * GLOBAL_BATCH
    assert first + _train(resumed, ITERS - 3) == pytest.approx(_megatron_rates(ITERS), rel=1e-12, abs=0)
    # a constant weight decay stays the optimizer's own (--weight-decay or the JSON's), not Megatron's default 0.01
    assert engine.optimizer.param_groups[0]["weight_decay"] == 0.05
    # changed flags on resume: Megatron's check, named, with its two ways out
    for changed, weight_decay in (([f if f != str(WARMUP) else "3" for f in SCHEDULE], 0.05), (SCHEDULE, 0.0)):
        with pytest.raises(DcpUsageError, match="changed since the checkpoint.*--override-opt_param-scheduler"):
            checkpoint.load(_engine(_schedule(tmp_path, changed), weight_decay=weight_decay), str(tmp_path / "ckpt"),
                            apply_config=False)
    # Megatron's --override-opt_param-scheduler: the new flags' schedule at the checkpoint's step count
    overridden = _engine(_schedule(tmp_path, [*SCHEDULE, "--lr-decay-iters", "7", "--override-opt_param-scheduler"]),
                         weight_decay=0.05)
    checkpoint.load(overridden, str(tmp_path / "ckpt"), apply_config=False)
    assert overridden.lr_scheduler.scheduler.lr_decay_steps == 7 * GLOBAL_BATCH
    assert overridden.get_lr()[0] == pytest.approx(
        MIN_LR + (PEAK - MIN_LR) * 0.5 * (1 + math.cos(math.pi * (3 - WARMUP) / (7 - WARMUP))), rel=1e-12)


def test_without_schedule_flags_the_json_decides(tmp_path):
    assert _schedule(tmp_path, ["--lr", str(PEAK)]) is None


@pytest.mark.parametrize("flags, extra, message", [
    (SCHEDULE, {"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": ITERS}}},
     ['"scheduler" block (WarmupCosineLR)', "--lr-decay-style", "give one"]),
    (["--lr-decay-style", "cosine", "--weight-decay-incr-style", "linear", "--start-weight-decay", "0",
      "--end-weight-decay", "0.1"], {"optimizer": {"type": "SGD", "params": {"lr": PEAK, "weight_decay": 0.1}}},
     ["--weight-decay-incr-style linear", '"weight_decay": 0.1']),
    (["--min-lr", "1.0"], {}, ["--min-lr 1.0 is above the peak learning rate 0.003"]),
    (["--lr-warmup-iters", str(ITERS)], {}, [f"--lr-warmup-iters {ITERS} must be below --train-iters {ITERS}"]),
])
def test_conflicts_stop_at_start(tmp_path, flags, extra, message):
    with pytest.raises(DcpUsageError) as err:
        _schedule(tmp_path, flags, **extra)
    assert all(part in str(err.value) for part in message), str(err.value)


@pytest.mark.parametrize("flags, message", [
    (["--lr-warmup-samples", "8"], "--lr-warmup-samples: the DeepSpeed script counts its run in --train-iters"),
    (["--override-opt_param-scheduler"], "only Megatron's scheduler reads it"),
])
def test_flags_that_cannot_run_are_refused(tmp_path, flags, message):
    with pytest.raises(DcpUsageError, match=message):
        _args(tmp_path, flags)
