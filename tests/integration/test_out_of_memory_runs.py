"""Runs that survive out-of-memory errors (issue 44): 2 CPU ranks on an emulated device
(`--dcp-device-memory-gb`, runtime/device_ceiling.py) planned at twice its memory, under torchrun's elastic
restarts (`--max-restarts`): every out-of-memory is named by the rank it happened on, recorded beside the
checkpoints, and the restarted run resumes from the last checkpoint under the record until every step trains.
The trained weights (validation loss after every step) and grad norms equal a 1-rank run's. Each launch restarts
a few times (~30 s per attempt on 2 cores): slow."""
from __future__ import annotations

import glob
import os
import re

import pytest

from tests.support.megatron_runs import OUR_SCRIPT, run_training
from tests.integration.test_deepspeed import SCHEDULE, _scheduled
from tests.integration.test_megatron_loop import RESUME_BASE
from tests.support.deepspeed_runs import run_deepspeed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

ITERS = 6
DEVICE_GB = 0.012          # the tiny Llama's 2-rank --dcp run peaks at ~0.0113 GiB planned at 0.007
OVER_BUDGET = ["--dcp-device-memory-gb", str(DEVICE_GB), "--dcp-memory-budget-gb", str(2 * DEVICE_GB)]
RESTARTS = 4
DS_EVAL = ["--eval-interval", "1", "--eval-iters", "1"]
TOLERANCE = 1e-5


def _checkpointed(root, name):
    directory = str(root / name)
    return ["--save", directory, "--load", directory, "--save-interval", "1", "--eval-interval", "1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("oom_runs")
    cache = {}
    specs = {
        # one rank, no DCP: the reference
        "reference": lambda: run_training(OUR_SCRIPT, ["--eval-interval", "1"], nproc=1, launcher=False,
                                          iters=ITERS, base=RESUME_BASE),
        # the count's own corrections off: only the records bring the plans under the device
        "restarts": lambda: run_training(
            OUR_SCRIPT, ["--dcp", *OVER_BUDGET, "--dcp-no-memory-probe", "--dcp-no-memory-refine", "--dcp-no-refine",
                         *_checkpointed(root, "ckpt")], launcher=False, iters=ITERS, base=RESUME_BASE,
            max_restarts=RESTARTS),
        # DeepSpeed ZeRO-1 (small buckets: DeepSpeed's default ones alone take ~1.9 GiB on the emulated device), and
        # one rank without ZeRO as its reference
        "ds_reference": lambda: run_deepspeed(_scheduled(stage=0), [*SCHEDULE, *DS_EVAL], nproc=1, iters=ITERS,
                                              directory=str(root), torchrun=False),
        "ds_restarts": lambda: run_deepspeed(
            _scheduled(stage=1, zero_optimization={"stage": 1, "reduce_bucket_size": 200_000,
                                                   "allgather_bucket_size": 200_000}),
            [*SCHEDULE, *DS_EVAL, "--dcp", *OVER_BUDGET, "--dcp-no-memory-refine", "--dcp-no-refine",
             "--save", str(root / "ds_ckpt"), "--load", str(root / "ds_ckpt"), "--save-interval", "1"],
            iters=ITERS, directory=str(root), max_restarts=RESTARTS),
    }

    def get(name):
        if name not in cache:
            cache[name] = specs[name]()
            (root / f"{name}.log").write_text(cache[name].output)
        return cache[name]

    get.root = root
    return get


def _records(root, name):
    return sorted(glob.glob(os.path.join(root, name, "dcp_memory_limits", "*.json")))


def _survived(runs, reference_name, run_name, checkpoints):
    """The run trained every step, named and recorded each out-of-memory it survived, restarted under the records
    with no traceback, and its weights after every step (validation loss) are the reference's; its events."""
    reference, run = runs(reference_name).check(), runs(run_name)
    assert run.returncode == 0, run.output[-3000:]
    assert sorted(run.losses) == list(range(1, ITERS + 1))
    events = [line for line in run.output.splitlines() if "out of memory in micro-batch" in line]
    records = _records(runs.root, checkpoints)
    # each out-of-memory survived is recorded by every rank it hit and named in a line; when two ranks hit one,
    # torchrun may stop the second after its record and before its line (the first rank's exit ends the group)
    named = {tuple(map(int, m.groups())) for m in (re.search(r"rank (\d+), iteration (\d+): out of memory", line)
                                                   for line in events) if m}
    recorded = {tuple(map(int, m.groups())) for m in (re.search(r"iteration(\d+)-rank(\d+)-", os.path.basename(path))
                                                      for path in records) if m}
    recorded = {(rank, iteration) for iteration, rank in recorded}
    assert events and len(named) == len(events) and named <= recorded, (events, records)
    assert {iteration for _, iteration in recorded} == {iteration for _, iteration in named}, (events, records)
    assert "out-of-memory record(s) under dcp_memory_limits/" in run.output   # a restart planned under them
    assert "Traceback" not in run.output
    assert sorted(run.eval_losses) == sorted(reference.eval_losses)
    for step, loss in reference.eval_losses.items():
        assert run.eval_losses[step] == pytest.approx(loss, rel=TOLERANCE), ("validation", step)
    return reference, run, events


def test_a_run_planned_above_its_device_trains_every_step_as_one_rank(runs):
    reference, run, events = _survived(runs, "reference", "restarts", "ckpt")
    assert all("live past the" in line and "device" in line for line in events)
    # and every step's grad norm is the reference's
    assert run.grad_norms == pytest.approx(reference.grad_norms, abs=1e-3)
    assert run.losses[ITERS] == pytest.approx(reference.losses[ITERS], rel=TOLERANCE)


def test_the_same_on_deepspeed_zero1(runs):
    reference, run, _ = _survived(runs, "ds_reference", "ds_restarts", "ds_ckpt")
    for step, loss in reference.losses.items():
        assert run.losses[step] == pytest.approx(loss, rel=TOLERANCE), ("training", step)
