"""One front door per engine: a start runs every shared start-up check once and builds the run's spec once, and
the seams that run later (Megatron's schedule) take the spec the start built instead of building another."""
from __future__ import annotations

import collections
import dataclasses
import json

import pytest

from tests.support.deepspeed_runs import TINY_MODEL, ds_config

pytest.importorskip("megatron.training")


@pytest.fixture
def counted(monkeypatch):
    """Every shared start check, counted by its first flag; and each construction of the run's DcpConfig."""
    from dcp_megatron.flags import start_checks

    calls = collections.Counter()

    def counting(check):
        def run(start):
            calls[check.reads[0]] += 1
            return check.run(start)
        return dataclasses.replace(check, run=run)

    monkeypatch.setattr(start_checks, "START_CHECKS", tuple(counting(c) for c in start_checks.START_CHECKS))
    return calls


def _count_calls(monkeypatch, calls, module, name):
    original = getattr(module, name)

    def counting(*args, **kwargs):
        calls[name] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)


def test_a_megatron_start_checks_once_and_its_schedule_takes_the_spec_it_built(counted, monkeypatch):
    import megatron.training
    import torch
    from megatron.training import arguments as megatron_arguments

    from dcp_megatron.config import RunSpecSlot
    from dcp_megatron.core import planning
    from dcp_megatron.deepspeed.arguments import megatron_parser
    from dcp_megatron.flags.dcp_flags import unwrapped
    from dcp_megatron.flags.start_checks import START_CHECKS
    from dcp_megatron.training import arguments, schedule
    from patches.training_arguments import _with_dcp_validation
    from patches.training_training import _with_dcp_schedule

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py"])
    for name in ("refuse_conflicting_flags", "start_megatron_run", "dcp_config_from_args", "check_plannable"):
        _count_calls(monkeypatch, counted, arguments, name)
    args = megatron_parser().parse_args(["--deepspeed-config", "x.json", *TINY_MODEL, "--train-iters", "4",
                                         "--eval-iters", "0", "--dcp", "--dcp-max-cp-size", "1"])
    args.world_size, args.rank = 1, 0
    specs = RunSpecSlot()
    _with_dcp_validation(unwrapped(megatron_arguments.validate_args), specs)(args, {"tokenizer_type": "NullTokenizer"})
    spec = specs.spec_of(args)
    assert spec.dcp.max_cp_size == 1 and spec.timeout_minutes == 3
    assert {check.reads[0]: counted[check.reads[0]] for check in START_CHECKS} == {
        check.reads[0]: 1 for check in START_CHECKS}
    assert [counted[name] for name in ("refuse_conflicting_flags", "start_megatron_run", "dcp_config_from_args",
                                       "check_plannable")] == [1, 1, 1, 1]

    built = {}
    monkeypatch.setattr(megatron.training, "get_args", lambda: args)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    monkeypatch.setattr(schedule, "DcpForwardBackward", lambda inner, **kwargs: built.update(kwargs))
    monkeypatch.setattr(planning, "model_shape_from_args", lambda run_args: None)   # (Megatron's tokenizer's)
    _with_dcp_schedule(lambda *a, **k: "Megatron's schedule", specs)()
    assert built["config"] is spec.dcp and counted["dcp_config_from_args"] == 1   # no second construction


def test_a_megatron_start_without_dcp_refuses_dcp_flags_once(counted, monkeypatch):
    from dcp_megatron.config import DcpUsageError
    from dcp_megatron.deepspeed.arguments import megatron_parser
    from dcp_megatron.training.arguments import validate_dcp_args

    args = megatron_parser().parse_args(["--deepspeed-config", "x.json", *TINY_MODEL, "--dcp-max-cp-size", "2"])
    args.world_size, args.rank, args.data_parallel_size = 1, 0, 1
    with pytest.raises(DcpUsageError, match="^--dcp-max-cp-size only take effect with --dcp$"):
        validate_dcp_args(args)
    assert counted["--dcp"] == 1


def test_a_deepspeed_start_checks_once(counted, monkeypatch, tmp_path):
    from dcp_megatron.deepspeed.arguments import parse_args
    from dcp_megatron.deepspeed.setup import deepspeed_setup
    from dcp_megatron.flags.start_checks import START_CHECKS

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    config = dict(ds_config(stage=1, total_steps=9), dcp={"enabled": True, "max_cp_size": 1})
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    args = parse_args([*TINY_MODEL, "--deepspeed-config", str(path), "--train-iters", "9"])
    _, dcp = deepspeed_setup(args, has_gpu=False)
    assert dcp.max_cp_size == 1
    assert {check.reads[0]: counted[check.reads[0]] for check in START_CHECKS} == {
        check.reads[0]: 1 for check in START_CHECKS}
