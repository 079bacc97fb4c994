"""The bad-input and fault matrix of both training paths (megatron.training + `--dcp`, and DeepSpeed).

Faults (one real torchrun launch each, 2 CPU ranks): SIGSTOP of one rank mid-step (Megatron and DeepSpeed:
the other rank stops within `--distributed-timeout-minutes` plus a margin, naming the iteration and the
stopped rank), SIGTERM to the torchrun agent mid-save (Megatron) and kill -9 of one rank mid-save
(DeepSpeed: torchrun names it), both leaving the latest checkpoint a complete, verified one, and a step at
`--lr inf` (Megatron's NaN check ends the run; the Inf weights are not saved).

Bad input (in this process, many cases, each through the same path a user's command takes: the
launcher's `main` for the Megatron path, the DeepSpeed script's `main`): exit status 2, a message naming
the problem and the flag, no training step and no process group (the problem is knowable at start), and
for checkpoint cases the checkpoint on disk untouched. Checkpoint cases corrupt copies of the real
checkpoints the fault runs left behind.
"""
from __future__ import annotations

import json
import os
import shutil
import signal

import pytest

from dcp_megatron.runtime import checkpoint_manifest as manifest_io
from tests.support.deepspeed_runs import DS_SCRIPT, TINY_MODEL, ds_config, load_ds_script, run_deepspeed
from tests.support.fault_runs import run_with_fault
from tests.support.megatron_runs import (CPU_FLAGS, LLAMA_TINY, OUR_SCRIPT, parse_output, run_env, run_training,
                                         strip_dcp_lines, torchrun_command)

pytestmark = pytest.mark.timeout(900)

TIMEOUT_MINUTES = 0.35     # --distributed-timeout-minutes of the SIGSTOP runs (Megatron's parser takes fractions)
MARGIN_S = 25              # heartbeat check (3 beats of 2 s), error handling and exit on a loaded 2-core machine
MEGATRON_DCP = ["--dcp", "--dcp-memory-budget-gb", "0.007"]
DS_DCP = ["--dcp", "--dcp-memory-budget-gb", "0.007"]
LONG_RUN = 200             # iterations: the faults come long before the end
MOE_EP2 = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
           "--moe-aux-loss-coeff", "0.01", "--expert-model-parallel-size", "2"]


def _megatron_flags(*extra: str) -> list[str]:
    return [*LLAMA_TINY, *CPU_FLAGS, "--train-iters", str(LONG_RUN), *MEGATRON_DCP, *extra]


def _ds_command(config_path: str, *extra: str) -> list[str]:
    flags = [*TINY_MODEL, "--deepspeed-config", config_path, "--train-iters", str(LONG_RUN), *DS_DCP, *extra]
    return torchrun_command(DS_SCRIPT, flags, nproc=2, launcher=False)


def _ds_env() -> dict:
    return dict(run_env(), DS_ACCELERATOR="cpu")


def _assert_verified(directory: str) -> dict:
    """A complete checkpoint: its manifest lists its files and every one matches."""
    manifest = manifest_io.read_manifest(directory)
    assert manifest is not None, f"{directory} has no checksum manifest"
    manifest_io.verify(directory, manifest, rank=0, world_size=1)
    return manifest


def _assert_stopped_rank_named(run, *, expect_prefix: str):
    message = run.seconds_to(expect_prefix)
    assert message is not None, run.output[-4000:]
    line = next(line for t, line in run.lines if expect_prefix in line and t >= 0)
    assert "rank 1 (stopped or dead" in line and "iteration " in line, line
    assert f"--distributed-timeout-minutes {TIMEOUT_MINUTES:g}" in line, line
    limit = TIMEOUT_MINUTES * 60 + MARGIN_S
    assert run.survivors_gone_s is not None and run.survivors_gone_s < limit, (
        f"the surviving rank took {run.survivors_gone_s} s to stop (limit {limit:.0f} s)\n{run.output[-3000:]}")


# ----------------------------------------------------------------------------------------------- faults

def test_megatron_sigstop_of_one_rank_mid_step_ends_the_run_naming_it():
    command = torchrun_command(OUR_SCRIPT, _megatron_flags("--distributed-timeout-minutes", str(TIMEOUT_MINUTES)),
                               nproc=2, launcher=False)
    # torchrun would wait its 30 s grace before SIGKILLing the stopped worker: the test ends the job instead.
    run = run_with_fault(command, trigger="iteration        2/", victim=1, sig=signal.SIGSTOP,
                         stop_after_survivors_s=2)
    _assert_stopped_rank_named(run, expect_prefix="dcp: error: rank 0, iteration")


@pytest.fixture(scope="module")
def megatron_terminated_mid_save(tmp_path_factory):
    """SIGTERM to torchrun while iteration 3 is being saved (every iteration saves), through the launcher."""
    root = tmp_path_factory.mktemp("megatron_fault")
    script = str(root / "user_pretrain_gpt.py")
    strip_dcp_lines(OUR_SCRIPT, script)
    save = root / "ckpt"
    command = torchrun_command(script, _megatron_flags("--save", str(save), "--save-interval", "1"), nproc=2,
                               launcher=True)
    run = run_with_fault(command, trigger="saving checkpoint at iteration       3", victim="agent",
                         sig=signal.SIGTERM)
    return run, save


def test_sigterm_to_the_launcher_mid_save_stops_every_worker_and_keeps_the_last_good_checkpoint(
        megatron_terminated_mid_save):
    run, save = megatron_terminated_mid_save
    assert run.returncode not in (0, None) and run.agent_exit_s is not None and run.agent_exit_s < 60, run.output[-3000:]
    assert "got signal: 15" in run.output, run.output[-3000:]
    assert not any(os.path.exists(f"/proc/{pid}") for pid in run.worker_pids), "a worker outlived the launcher"
    latest = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert latest in (2, 3), latest          # 3 only if the signal came after Megatron's save had finished
    directory = save / f"iter_{latest:07d}"
    if (directory / manifest_io.MANIFEST_FILE).exists():
        manifest = _assert_verified(str(directory))
        assert any(name.endswith(".distcp") for name in manifest["files"])
    else:
        # Stopped between Megatron's tracker update (after every rank wrote its files) and the manifest: the
        # checkpoint is complete but unverified; the one before it has its manifest.
        assert latest == 3 and sorted(p.name for p in directory.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
        _assert_verified(str(save / f"iter_{latest - 1:07d}"))


def test_a_step_at_infinite_lr_stops_without_saving_inf_weights(tmp_path):
    save = tmp_path / "ckpt"
    run = run_training(OUR_SCRIPT, [*MEGATRON_DCP, "--lr", "inf", "--save", str(save), "--save-interval", "1"],
                       iters=4, launcher=False)
    assert run.returncode != 0
    assert "the weights hold NaN/Inf, so they are not saved" in run.output, run.output[-3000:]
    assert "exitcode: 16" in run.output, run.output[-3000:]    # Megatron's rerun state machine: a reproducible NaN
    assert not (save / "latest_checkpointed_iteration.txt").exists() and sorted(run.losses) == [1]


@pytest.mark.slow
def test_sigterm_mid_step_with_exit_signal_handler_saves_and_ends_naming_the_step(tmp_path):
    """--exit-signal-handler under --dcp, on Megatron's blended GPT datasets (two weighted corpora): SIGTERM to one
    rank while step 3 runs. The ranks agree (Megatron all-gathers the flag after each step), save the step they
    finished, exit 0, and one line names that step and the save (patches/training_training.py)."""
    from tests.support.deepspeed_runs import write_blend

    blend = write_blend(str(tmp_path))
    save = tmp_path / "ckpt"
    base = [flag for flag in LLAMA_TINY if flag not in ("--mock-data", "--split", "98,1,1")]
    flags = [*base, *CPU_FLAGS, "--train-iters", str(LONG_RUN), *MEGATRON_DCP, *blend, "--exit-signal-handler",
             "--save", str(save), "--save-interval", str(LONG_RUN)]
    run = run_with_fault(torchrun_command(OUR_SCRIPT, flags, nproc=2, launcher=False), trigger="iteration        2/",
                         victim=1, sig=signal.SIGTERM)
    assert run.returncode == 0 and run.agent_exit_s is not None and run.agent_exit_s < 60, run.output[-3000:]
    lines = [line for line in run.output.splitlines() if "received (--exit-signal-handler)" in line]
    assert len(lines) == 1 and lines[0].startswith("dcp: SIGTERM received"), run.output[-3000:]
    step = int(lines[0].split("stopped after iteration ")[1].split(";")[0])
    assert step >= 2 and f"saved to --save {save}" in lines[0], lines
    trained = parse_output(run.returncode, run.output)
    assert sorted(trained.losses) == list(range(1, step + 1)) and len(trained.dcp_steps) == step, run.output[-3000:]
    assert int((save / "latest_checkpointed_iteration.txt").read_text()) == step
    _assert_verified(str(save / f"iter_{step:07d}"))


def test_deepspeed_sigstop_of_one_rank_mid_step_ends_the_run_naming_it(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(ds_config(stage=1, total_steps=LONG_RUN)))
    command = _ds_command(str(config), "--distributed-timeout-minutes", str(TIMEOUT_MINUTES))
    run = run_with_fault(command, trigger="iteration        2/", victim=1, sig=signal.SIGSTOP, env=_ds_env(),
                         stop_after_survivors_s=2)
    _assert_stopped_rank_named(run, expect_prefix="error: rank 0, iteration")


@pytest.fixture(scope="module")
def deepspeed_killed_mid_save(tmp_path_factory):
    """kill -9 of rank 1 while iteration 3 is being saved (every iteration saves)."""
    root = tmp_path_factory.mktemp("ds_fault")
    config = root / "ds.json"
    config.write_text(json.dumps(ds_config(stage=1, total_steps=LONG_RUN)))
    save = root / "ckpt"
    command = _ds_command(str(config), "--save", str(save), "--save-interval", "1")
    run = run_with_fault(command, trigger="saving checkpoint at iteration 3", victim=1, sig=signal.SIGKILL,
                         env=_ds_env())
    return run, save


def test_deepspeed_kill_of_one_rank_mid_save_keeps_the_last_good_checkpoint(deepspeed_killed_mid_save):
    run, save = deepspeed_killed_mid_save
    assert run.returncode not in (0, None) and run.agent_exit_s is not None and run.agent_exit_s < 120, run.output[-3000:]
    assert f"pid: {run.victim_pid}" in run.output and "rank      : 1 (local_rank: 1)" in run.output, run.output[-3000:]
    assert "error: rank 0, " in run.output, run.output[-3000:]   # the survivor says where it was
    tag = (save / "latest").read_text().strip()
    assert tag in ("iter_0000002", "iter_0000003"), tag   # 3 only if the kill came after the save had finished
    manifest = _assert_verified(str(save / tag))
    assert any(name.endswith("model_states.pt") for name in manifest["files"])


# ------------------------------------------------------------------------------------ bad input at start

class Work:
    """What a case builds its input from: a scratch directory and the fault runs' real checkpoints."""

    def __init__(self, root, megatron_save=None, ds_save=None):
        self.root, self.megatron_save, self.ds_save = root, megatron_save, ds_save
        self.a_file = root / "a_file"
        self.a_file.write_text("not a directory")

    def prefix(self) -> str:
        """A --data-path prefix of a real (tiny) megatron-core .bin/.idx pair."""
        import numpy as np
        import torch
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        prefix = str(self.root / "corpus")
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
        for length in (5, 9):
            builder.add_document(torch.from_numpy(np.arange(length, dtype=np.uint16)), [length])
        builder.finalize(prefix + ".idx")
        return prefix

    def truncated_prefix(self) -> str:
        """A real pair whose .bin lost its last bytes (a copy cut short)."""
        prefix = self.prefix()
        with open(prefix + ".bin", "r+b") as f:
            f.truncate(10)
        return prefix

    def profile(self, text: str) -> str:
        path = self.root / f"profile_{abs(hash(text))}.json"
        path.write_text(text)
        return str(path)

    def megatron_checkpoint(self) -> tuple[str, str]:
        """A copy of the killed run's latest verified checkpoint: (the --load directory, its iteration directory)."""
        name = max(p.parent.name for p in self.megatron_save.glob(f"iter_*/{manifest_io.MANIFEST_FILE}"))
        copy = self.root / "megatron_ckpt"
        shutil.copytree(self.megatron_save / name, copy / name)
        (copy / "latest_checkpointed_iteration.txt").write_text(str(int(name.split("_")[1])))
        return str(copy), str(copy / name)

    def ds_checkpoint(self) -> tuple[str, str]:
        tag = (self.ds_save / "latest").read_text().strip()
        copy = self.root / "ds_ckpt"
        shutil.copytree(self.ds_save / tag, copy / tag)
        (copy / "latest").write_text(tag)
        return str(copy), str(copy / tag)


def _flip_byte(path: str) -> None:
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))


def _truncate(path: str, keep: float = 0.5) -> None:
    data = open(path, "rb").read()
    open(path, "wb").write(data[:int(len(data) * keep)])


def _megatron_corrupt(work, damage, pick) -> tuple[list[str], int]:
    load, directory = work.megatron_checkpoint()
    files = manifest_io.checkpoint_files(directory)
    index = pick(files)
    damage(os.path.join(directory, files[index]))
    # Rank r hashes files r, r+W, ...: check as the rank whose share holds the damaged file.
    return [*MEGATRON_DCP, "--load", load], index % 2


def _megatron_changed(*flags: str):
    return lambda work: ([*MEGATRON_DCP, "--load", work.megatron_checkpoint()[0], *flags], 0)


def _distcp(files):
    return next(i for i, f in enumerate(files) if f.endswith(".distcp"))


def _last_distcp(files):
    return max(i for i, f in enumerate(files) if f.endswith(".distcp"))


MEGATRON_CASES = {
    # flags DCP cannot honour, or values that are not values
    "cp2_with_dcp": (lambda w: (["--dcp", "--context-parallel-size", "2"], 0), ["--context-parallel-size 2 conflicts with --dcp"]),
    "budget_nan": (lambda w: (["--dcp", "--dcp-memory-budget-gb", "nan"], 0), ["--dcp-memory-budget-gb must be a positive"]),
    "budget_inf": (lambda w: (["--dcp", "--dcp-memory-budget-gb", "inf"], 0), ["--dcp-memory-budget-gb must be a positive"]),
    "budget_negative": (lambda w: (["--dcp", "--dcp-memory-budget-gb", "-1"], 0), ["--dcp-memory-budget-gb must be a positive"]),
    "dcp_flag_without_dcp": (lambda w: (["--dcp-policy", "static"], 0), ["only take effect with --dcp"]),
    "recompute_unknown": (lambda w: ([*MEGATRON_DCP, "--dcp-recompute", "none,sometimes"], 0), ["--dcp-recompute", "sometimes"]),
    "max_cp_over_domain": (lambda w: ([*MEGATRON_DCP, "--dcp-max-cp-size", "4"], 0), ["--dcp-max-cp-size 4 exceeds the DCP domain of 2"]),
    "megatron_recompute": (lambda w: ([*MEGATRON_DCP, "--recompute-granularity", "full", "--recompute-method", "uniform"], 0), ["--dcp-recompute"]),
    "attention_dropout": (lambda w: ([*MEGATRON_DCP, "--attention-dropout", "0.1"], 0), ["--attention-dropout"]),
    "ulysses_on_megatron": (lambda w: ([*MEGATRON_DCP, "--dcp-cp-attention", "ulysses"], 0), ["--dcp-cp-attention ulysses", "DeepSpeed"]),
    "timeout_zero": (lambda w: ([*MEGATRON_DCP, "--distributed-timeout-minutes", "0"], 0), ["--distributed-timeout-minutes must be positive"]),
    # issue 44: memory flags a layout cannot honour, a device memory that is not a size
    "memory_probe_under_pp2": (lambda w: ([*MEGATRON_DCP, "--pipeline-model-parallel-size", "2", "--dcp-memory-probe"], 0),
                               ["--dcp-memory-probe cannot run under --pipeline-model-parallel-size 2", "run PP 1"]),
    "device_memory_negative": (lambda w: ([*MEGATRON_DCP, "--dcp-device-memory-gb", "-1"], 0),
                               ["--dcp-device-memory-gb must be a positive"]),
    # the longest document against the memory budget: flags to change named, before any model
    "fits_no_group": (lambda w: (["--dcp", "--dcp-memory-budget-gb", "0.0013", "--dcp-recompute", "none"], 0),
                      ["fits no CP group of this 2-rank domain", "--dcp-memory-budget-gb", "--dcp-recompute", "--seq-length",
                       "(--dcp-memory-budget-gb 0.0013 less the 10% safety margin"]),
    "static_state_over_budget": (lambda w: (["--dcp", "--dcp-memory-budget-gb", "0.0001"], 0), ["GiB per rank", "--dcp-memory-budget-gb", "--use-distributed-optimizer"]),
    # profiles
    "profile_missing": (lambda w: ([*MEGATRON_DCP, "--dcp-profile", str(w.root / "none.json")], 0), ["--dcp-profile", "no such file"]),
    "profile_not_json": (lambda w: ([*MEGATRON_DCP, "--dcp-profile", w.profile("{gemm_flops: 1")], 0), ["--dcp-profile", "not valid JSON"]),
    "profile_nan": (lambda w: ([*MEGATRON_DCP, "--dcp-profile", w.profile('{"gemm_flops": NaN}')], 0), ["--dcp-profile", "gemm_flops must be a positive finite number"]),
    "profile_infinity": (lambda w: ([*MEGATRON_DCP, "--dcp-profile", w.profile('{"intra_node_bw": Infinity}')], 0), ["intra_node_bw must be a positive finite number"]),
    "profile_string": (lambda w: ([*MEGATRON_DCP, "--dcp-profile", w.profile('{"attn_rate_points": [["4096", 1e12]]}')], 0), ["--dcp-profile", "attn_rate_points"]),
    "profile_unknown_key": (lambda w: ([*MEGATRON_DCP, "--dcp-profile", w.profile('{"gemm_flop": 1e12}')], 0), ["--dcp-profile", "unknown keys ['gemm_flop']"]),
    # the profiler's run (dcp-profile sets these flags)
    "profile_out_dir_missing": (lambda w: ([*MEGATRON_DCP, "--dcp-profile-out", str(w.root / "no" / "p.json")], 0),
                                ["--dcp-profile-out", "no such directory"]),
    "profile_with_pp2": (lambda w: ([*MEGATRON_DCP, "--dcp-profile-out", str(w.root / "p.json"),
                                     "--pipeline-model-parallel-size", "2"], 0), ["profiler runs one pipeline stage"]),
    "profile_report_without_out": (lambda w: ([*MEGATRON_DCP, "--dcp-profile-report", str(w.root / "r.json")], 0),
                                   ["--dcp-profile-report needs --dcp-profile-out"]),
    # output and resume paths
    "save_is_a_file": (lambda w: ([*MEGATRON_DCP, "--save", str(w.a_file), "--save-interval", "2"], 0), ["--save", "exists and is not a directory"]),
    "save_under_a_file": (lambda w: ([*MEGATRON_DCP, "--save", str(w.a_file / "sub"), "--save-interval", "2"], 0), ["--save", "is a file"]),
    "tensorboard_is_a_file": (lambda w: ([*MEGATRON_DCP, "--tensorboard-dir", str(w.a_file)], 0), ["--tensorboard-dir"]),
    "dump_plans_is_a_file": (lambda w: ([*MEGATRON_DCP, "--dcp-dump-plans", str(w.a_file)], 0), ["--dcp-dump-plans"]),
    "load_missing": (lambda w: ([*MEGATRON_DCP, "--load", str(w.root / "missing")], 0), ["--load", "no such directory"]),
    "load_empty": (lambda w: ([*MEGATRON_DCP, "--load", str(w.root)], 0), ["--load", "holds no Megatron checkpoint"]),
    # the real checkpoint of the killed run, damaged
    "ckpt_flipped_byte_shard0": (lambda w: _megatron_corrupt(w, _flip_byte, _distcp), ["does not match its saved checksum"]),
    "ckpt_flipped_byte_shard1": (lambda w: _megatron_corrupt(w, _flip_byte, _last_distcp), ["does not match its saved checksum"]),
    "ckpt_truncated": (lambda w: _megatron_corrupt(w, _truncate, _distcp), [".distcp has", "were saved (truncated"]),
    "ckpt_empty_file": (lambda w: _megatron_corrupt(w, lambda p: _truncate(p, 0.0), _distcp), ["has 0 bytes"]),
    "ckpt_metadata_missing": (lambda w: _megatron_corrupt(w, os.remove, lambda files: files.index(".metadata")), [".metadata is missing"]),
    "ckpt_manifest_garbage": (lambda w: _megatron_corrupt(
        w, lambda p: open(os.path.join(os.path.dirname(p), manifest_io.MANIFEST_FILE), "w").write("{"), _distcp),
        ["unreadable checksum manifest"]),
    # resuming with changed schedule flags
    "resume_longer_train_iters": (lambda w: ([*MEGATRON_DCP, "--load", w.megatron_checkpoint()[0], "--train-iters", "400"], 0),
                                  ["lr_decay_steps", "--train-iters", "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"]),
    "resume_new_lr": (_megatron_changed("--lr", "2e-3"), ["max_lr 0.002 (checkpoint: 0.001", "--no-load-optim"]),
    "resume_new_warmup": (_megatron_changed("--lr-warmup-iters", "5"), ["lr_warmup_steps", "--lr-warmup-iters"]),
    "resume_new_decay_style": (_megatron_changed("--lr-decay-style", "linear"), ["lr_decay_style linear (checkpoint: cosine"]),
    # issue 30: an empty recompute list is refused as on the DeepSpeed path (also where EP 2 bans full recompute)
    "recompute_empty": (lambda w: ([*MEGATRON_DCP, "--dcp-recompute", ""], 0), ["--dcp-recompute: unknown empty list"]),
    "recompute_comma_ep2": (lambda w: ([*MEGATRON_DCP, *MOE_EP2, "--dcp-recompute", ","], 0), ["--dcp-recompute: unknown empty list"]),
    "fits_no_group_ep2": (lambda w: (["--dcp", "--dcp-memory-budget-gb", "0.0027", *MOE_EP2], 0),   # static state fits
                          ["fits no CP group", "raise --dcp-memory-budget-gb to at least",
                           "(full recompute is off under --expert-model-parallel-size 2)"]),
    "seq_not_divisible_by_tp_sp": (lambda w: ([*MEGATRON_DCP, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                               "--seq-length", "1001"], 0),
                                   ["--seq-length 1001 is not divisible by --tensor-model-parallel-size 2", "evaluation",
                                    "multiple of 2 (e.g. 1000)", "--eval-iters 0"]),
    "tensorboard_not_writable": (lambda w: ([*MEGATRON_DCP, "--tensorboard-dir", "/sys/dcp-tensorboard"], 0),
                                 ["--tensorboard-dir /sys/dcp-tensorboard", "/sys is not writable"]),
    "rampup_batch_size": (lambda w: ([*MEGATRON_DCP, "--rampup-batch-size", "2", "2", "100"], 0),
                          ["--rampup-batch-size 2 2 100 is ignored", '--step-batch-size-schedule "0:2 34816:4 68608:6 102400:8"']),
    # issue 36: nccl given on a machine without a GPU (CPU_FLAGS' gloo overridden: the last flag wins); a torch_dist
    # checkpoint resumed with --ckpt-format torch (megatron-core fails on it after building the model)
    "nccl_without_gpu": (lambda w: ([*MEGATRON_DCP, "--distributed-backend", "nccl"], 0),
                         ["--distributed-backend nccl needs a GPU", "--distributed-backend gloo"]),
    "resume_torch_dist_as_torch": (_megatron_changed("--ckpt-format", "torch"),
                                   ["is a torch_dist checkpoint and --ckpt-format is torch", "--ckpt-format torch_dist"]),
    # issue 46: validate_args turned it into granularity selective after our check
    "recompute_activations": (lambda w: ([*MEGATRON_DCP, "--recompute-activations"], 0),
                              ["--recompute-activations conflicts with --dcp", "--dcp-recompute none,selective"]),
}


@pytest.fixture(scope="module")
def user_script(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("user") / "user_pretrain_gpt.py")
    strip_dcp_lines(OUR_SCRIPT, path)
    return path


@pytest.mark.parametrize("case", sorted(MEGATRON_CASES))
def test_megatron_bad_input_stops_at_start(case, request, user_script, tmp_path, monkeypatch, capsys):
    """The user's unmodified script through `python -m dcp_megatron.launch` (as torchrun runs it on rank 0/1)."""
    build, messages = MEGATRON_CASES[case]
    needs_checkpoint = case.startswith(("ckpt_", "resume_"))
    save = request.getfixturevalue("megatron_terminated_mid_save")[1] if needs_checkpoint else None
    work = Work(tmp_path, megatron_save=save)
    extra, rank = build(work)
    before = _snapshot(save)
    launch_refused_in_one_line(monkeypatch, capsys, [user_script, *LLAMA_TINY, *CPU_FLAGS, "--train-iters",
                                                     str(LONG_RUN), *extra], messages, rank=rank)
    assert _snapshot(save) == before, "the run's checkpoint must stay as it was"


def launch_refused_in_one_line(monkeypatch, capsys, argv, messages, *, rank=0):
    """`launch.main(argv)` in this process as rank `rank` of 2 (no torchrun: no LOCAL_WORLD_SIZE) ends with one
    refusal line naming `messages`, exit 2, and no process group."""
    import sys

    import torch

    from dcp_megatron import launch

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(SystemExit) as exited:
        launch.main(argv)
    out = capsys.readouterr()
    _assert_refused(exited.value.code, out.err, out.out, messages, prefix="dcp: error: ")
    assert not torch.distributed.is_initialized(), "no process group may exist before a refused start"


def _snapshot(save) -> dict | None:
    if save is None:
        return None
    return {str(p): os.path.getsize(p) for p in save.rglob("*") if p.is_file()}


def _assert_refused(code, err, out, messages, *, prefix):
    assert code == 2, (code, err[-3000:], out[-2000:])
    lines = [line for line in err.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, err[-3000:]
    for message in messages:
        assert message in lines[0], (message, lines[0])
    assert "Traceback" not in err and " iteration " not in out, (err[-2000:], out[-2000:])


def _ds_corrupt(work, damage, suffix):
    load, directory = work.ds_checkpoint()
    target = next(f for f in manifest_io.checkpoint_files(directory) if f.endswith(suffix))
    damage(os.path.join(directory, target))
    return ds_config(stage=1, total_steps=LONG_RUN), [*DS_DCP, "--load", load]


def _ds_changed(**changes):
    def build(work):
        config = ds_config(stage=1, total_steps=LONG_RUN)
        for block, params in changes.items():
            config[block]["params"].update(params)
        return config, [*DS_DCP, "--load", work.ds_checkpoint()[0]]
    return build


def _block(**keys):
    return dict(ds_config(stage=1, total_steps=LONG_RUN), dcp=dict(enabled=True, **keys))


DS_CASES = {
    "zero3_offload": (lambda w: (ds_config(stage=3, total_steps=LONG_RUN), ["--dcp", "--dcp-recompute", "none,offload"]), ["ZeRO stage 3", "drop 'offload'"]),
    "grad_accumulation": (lambda w: (dict(ds_config(stage=1), gradient_accumulation_steps=4), ["--dcp"]), ['"gradient_accumulation_steps": 4']),
    "unmanaged_accumulation": (lambda w: (dict(ds_config(stage=1), managed_gradient_accumulation=False), ["--dcp"]), ['"managed_gradient_accumulation": false']),
    "no_optimizer": (lambda w: ({"zero_optimization": {"stage": 1}}, ["--dcp"]), ['add an "optimizer" block']),
    "block_unknown_key": (lambda w: (_block(max_cp=2), []), ["unknown key(s) ['max_cp']"]),
    "block_bad_type": (lambda w: (_block(memory_budget_gb="lots"), []), ["memory_budget_gb"]),
    "config_missing": (lambda w: (str(w.root / "none.json"), ["--dcp"]), ["--deepspeed-config", "no such file"]),
    "config_not_json": (lambda w: (w.profile("{zero"), ["--dcp"]), ["--deepspeed-config", "not valid JSON"]),
    "schedule_shorter_than_run": (lambda w: (ds_config(stage=1, total_steps=10, scheduler={"type": "WarmupDecayLR", "params": {"total_num_steps": 10, "warmup_num_steps": 2}}), ["--dcp"]),
                                  ['past the scheduler\'s "total_num_steps": 10', "learning rate 0"]),
    "dcp_flag_without_dcp": (lambda w: (ds_config(stage=1, total_steps=LONG_RUN), ["--dcp-max-cp-size", "2"]), ["only take effect with --dcp"]),
    "budget_nan": (lambda w: (ds_config(stage=1, total_steps=LONG_RUN), ["--dcp", "--dcp-memory-budget-gb", "nan"]), ["--dcp-memory-budget-gb must be a positive"]),
    "fits_no_group": (lambda w: (ds_config(stage=1, total_steps=LONG_RUN), ["--dcp", "--dcp-memory-budget-gb", "0.0012", "--dcp-recompute", "none"]),
                      ["fits no CP group", "--dcp-memory-budget-gb"]),
    "cp_attention_unknown": (lambda w: (ds_config(stage=1, total_steps=LONG_RUN), ["--dcp", "--dcp-cp-attention", "a2a"]), ["--dcp-cp-attention: unknown ['a2a']"]),
    "profile_nan": (lambda w: (ds_config(stage=1, total_steps=LONG_RUN), ["--dcp", "--dcp-profile", w.profile('{"gemm_flops": NaN}')]), ["--dcp-profile", "positive finite"]),
    "megatron_lr_flag": (lambda w: (ds_config(stage=1, total_steps=LONG_RUN), ["--dcp", "--lr", "1e-3"]), ["--lr 0.001 disagrees", '"lr": 0.003']),
    "megatron_schedule_and_json_scheduler": (lambda w: (ds_config(stage=1, total_steps=LONG_RUN), ["--dcp", "--lr-decay-style", "cosine"]),
                                             ["--lr-decay-style", '"scheduler" block (WarmupCosineLR)', "give one"]),
    "megatron_schedule_samples": (lambda w: (ds_config(stage=1, total_steps=LONG_RUN), ["--dcp", "--lr-warmup-samples", "8"]),
                                  ["--lr-warmup-samples", "--train-iters steps", "--lr-warmup-iters"]),
    "megatron_train_samples": (lambda w: (ds_config(stage=1, total_steps=LONG_RUN), ["--dcp", "--train-samples", "800"]), ["--train-samples", "give --train-iters instead"]),
    "tensor_parallel": (lambda w: (ds_config(stage=1, total_steps=LONG_RUN), ["--dcp", "--tensor-model-parallel-size", "2"]), ["--tensor-model-parallel-size 2", "TP = PP = 1"]),
    "batch_not_divisible": (lambda w: (ds_config(stage=1, total_steps=LONG_RUN), ["--dcp", "--global-batch-size", "3", "--micro-batch-size", "2"]), ["--global-batch-size"]),
    "data_path_missing": (lambda w: (ds_config(stage=1, total_steps=LONG_RUN), ["--dcp", "--data-path", "1", str(w.root / "x")]), ["--data-path", "x.bin"]),
    "timeout_zero": (lambda w: (ds_config(stage=1, total_steps=LONG_RUN), ["--dcp", "--distributed-timeout-minutes", "0"]), ["--distributed-timeout-minutes must be positive"]),
    "data_path_and_mock": (lambda w: (ds_config(stage=1, total_steps=LONG_RUN), ["--dcp", "--data-path", w.prefix()]), ["exactly one of --data-path"]),
    "data_bin_truncated": (lambda w: (ds_config(stage=1, total_steps=LONG_RUN), ["--dcp", "--data-path", w.truncated_prefix()]), ["--data-path", "corpus.bin holds 10 bytes", "do not belong together"]),
    "save_is_a_file": (lambda w: (ds_config(stage=1, total_steps=LONG_RUN), ["--dcp", "--save", str(w.a_file)]), ["--save", "exists and is not a directory"]),
    "dump_plans_is_a_file": (lambda w: (ds_config(stage=1, total_steps=LONG_RUN), ["--dcp", "--dcp-dump-plans", str(w.a_file)]), ["--dcp-dump-plans"]),
    "save_interval_without_save": (lambda w: (ds_config(stage=1, total_steps=LONG_RUN), ["--dcp", "--save-interval", "2"]), ["--save-interval needs --save"]),
    "load_missing": (lambda w: (ds_config(stage=1, total_steps=LONG_RUN), ["--dcp", "--load", str(w.root / "missing")]), ["--load", "no such directory"]),
    "load_empty": (lambda w: (ds_config(stage=1, total_steps=LONG_RUN), ["--dcp", "--load", str(w.root)]), ["--load", "holds no DeepSpeed checkpoint"]),
    "ckpt_flipped_byte": (lambda w: _ds_corrupt(w, _flip_byte, "model_states.pt"), ["model_states.pt does not match its saved checksum"]),
    "ckpt_truncated": (lambda w: _ds_corrupt(w, _truncate, "optim_states.pt"), ["optim_states.pt has", "truncated"]),
    "ckpt_file_missing": (lambda w: _ds_corrupt(w, os.remove, "model_states.pt"), ["model_states.pt is missing"]),
    "resume_new_lr": (_ds_changed(optimizer={"lr": 1e-3}), ['"optimizer"', "'lr': 0.001", "--override-optimizer-config"]),
    "resume_new_warmup": (_ds_changed(scheduler={"warmup_num_steps": 5}), ['"scheduler"', "--override-optimizer-config"]),
    # issue 30 (these cases run as one rank: WORLD_SIZE unset)
    "recompute_empty": (lambda w: (ds_config(stage=1, total_steps=LONG_RUN), ["--dcp", "--dcp-recompute", ""]), ["--dcp-recompute: unknown empty list"]),
    "block_max_cp_over_domain": (lambda w: (_block(max_cp_size=2), []), ['"dcp" max_cp_size) 2 exceeds the DCP domain of 1 ranks']),
    "memory_probe": (lambda w: (ds_config(stage=1, total_steps=LONG_RUN), ["--dcp", "--dcp-memory-probe"]),
                     ["--dcp-memory-probe: the memory probe before step 1 runs under megatron.training only"]),
    "bf16_and_fp16": (lambda w: (ds_config(stage=1, total_steps=LONG_RUN, bf16={"enabled": True}, fp16={"enabled": True}), ["--dcp"]),
                      ['"bf16" and "fp16" are both enabled']),
    "train_batch_size_disagrees": (lambda w: (ds_config(stage=1, total_steps=LONG_RUN, train_batch_size=8), ["--dcp"]),
                                   ['"train_batch_size": 8', "disagrees with --global-batch-size 4"]),
    "resume_on_fewer_ranks": (lambda w: (ds_config(stage=1, total_steps=LONG_RUN), [*DS_DCP, "--load", w.ds_checkpoint()[0]]),
                              ["partitioned over 2 data-parallel ranks and this run has 1", "resume on 2 ranks"]),
    "rampup_batch_size": (lambda w: (ds_config(stage=1, total_steps=LONG_RUN), ["--dcp", "--rampup-batch-size", "2", "2", "100"]),
                          ["--rampup-batch-size 2 2 100 is ignored"]),
    "megatron_writer_flag": (lambda w: (ds_config(stage=1, total_steps=LONG_RUN), ["--dcp", "--tensorboard-dir", str(w.root)]),
                             ["--tensorboard-dir", 'monitor blocks', '"tensorboard"']),
    # issue 36: DeepSpeed loaded it only as far as an assertion (stage 3 vs 1-2) or with a fresh optimizer (1-2 vs 0)
    "resume_under_another_zero_stage": (lambda w: (ds_config(stage=3, total_steps=LONG_RUN), [*DS_DCP, "--load", w.ds_checkpoint()[0]]),
                                        ["saved under ZeRO stage 1 and the DeepSpeed config asks for stage 3",
                                         '"zero_optimization": {"stage": 1}']),
    # issue 36
    "nccl_without_gpu": (lambda w: (ds_config(stage=1, total_steps=LONG_RUN), ["--dcp", "--distributed-backend", "nccl"]),
                         ["--distributed-backend nccl needs a GPU", "--distributed-backend gloo"]),
    # issue 46: Megatron's recompute flags and DeepSpeed's own block under DCP, flags the script does not run
    "recompute_activations_under_dcp": (lambda w: (ds_config(stage=1, total_steps=LONG_RUN), ["--dcp", "--recompute-activations"]),
                                        ["--recompute-activations conflicts with --dcp", "--dcp-recompute none,selective"]),
    "recompute_full_under_dcp_block": (lambda w: (_block(), ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                                             "--recompute-num-layers", "1"]),
                                       ["--recompute-granularity full conflicts with --dcp", "--dcp-recompute none,full"]),
    "activation_checkpointing_block": (lambda w: (ds_config(stage=1, total_steps=LONG_RUN, activation_checkpointing={"partition_activations": True}), ["--dcp"]),
                                       ['"activation_checkpointing" block', "--dcp-recompute"]),
    "ckpt_step": (lambda w: (ds_config(stage=1, total_steps=LONG_RUN), ["--dcp", "--ckpt-step", "3"]), ["--ckpt-step 3", "'latest' file"]),
    "megatron_flag_not_run": (lambda w: (ds_config(stage=1, total_steps=LONG_RUN), ["--dcp", "--exit-duration-in-mins", "1"]),
                              ["--exit-duration-in-mins is a megatron.training flag the DeepSpeed script does not run"]),
}


@pytest.mark.parametrize("case", sorted(DS_CASES))
def test_deepspeed_bad_input_stops_at_start(case, request, tmp_path, monkeypatch, capsys):
    """pretrain_gpt_deepspeed.py's `main` (what `python pretrain_gpt_deepspeed.py ...` runs), one rank's view."""
    import torch

    build, messages = DS_CASES[case]
    needs_checkpoint = case.startswith(("ckpt_", "resume_"))
    save = request.getfixturevalue("deepspeed_killed_mid_save")[1] if needs_checkpoint else None
    work = Work(tmp_path, ds_save=save)
    config, flags = build(work)
    if isinstance(config, dict):
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(config))
        config = str(path)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    before = _snapshot(save)
    code = load_ds_script().main([*TINY_MODEL, "--deepspeed-config", config, "--train-iters", str(LONG_RUN), *flags])
    out = capsys.readouterr()
    _assert_refused(code, out.err, out.out, messages, prefix="error: ")
    assert not torch.distributed.is_initialized(), "no process group may exist before a refused start"
    assert _snapshot(save) == before, "the run's checkpoint must stay as it was"


def test_bad_input_through_real_processes(tmp_path):
    """The same refusals from real processes: our script by plain torchrun (no launcher: the two dcp lines) on a
    --save another live run holds, 2 ranks, and a plain DeepSpeed script process: exit 2, one line, no worker
    traceback, nothing trained."""
    from tests.integration.test_start_checks import _live_lock

    save = tmp_path / "ckpt"
    _live_lock(save)
    megatron = run_training(OUR_SCRIPT, [*MEGATRON_DCP, "--save", str(save), "--save-interval", "2"], iters=3,
                            launcher=False, timeout_s=300)
    assert megatron.returncode != 0 and "exitcode  : 2" in megatron.output, megatron.output[-3000:]
    lines = [line for line in megatron.output.splitlines() if line.startswith("dcp: error: ")]
    # Rank 1 refuses on rank 0's verdict; whichever exits first, torchrun stops the other (maybe before it prints).
    assert 1 <= len(lines) <= 2 and len(set(lines)) == 1, megatron.output[-3000:]
    assert "--save" in lines[0] and "is held by another run" in lines[0], lines
    # The only traceback is torchrun's own summary of a failed worker, not a worker's DcpUsageError.
    assert megatron.output.count("Traceback") == megatron.output.count("raise ChildFailedError("), megatron.output[-3000:]
    assert "DcpUsageError" not in megatron.output and not megatron.losses, megatron.output[-3000:]
    assert json.loads((save / ".dcp-save.lock").read_text())["token"] == "another-run", "the holder keeps its lock"
    ds = run_deepspeed(_block(max_cp=2), [], directory=str(tmp_path), torchrun=False)
    assert ds.returncode == 2 and "unknown key(s) ['max_cp']" in ds.output, ds.output[-3000:]
    assert " iteration " not in ds.output and "Traceback" not in ds.output, ds.output[-3000:]
