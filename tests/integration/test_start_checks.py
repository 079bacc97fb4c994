"""Start-up refusals of issue 21 (one line, exit 2, before any process group) and the pieces behind them.

In-process cases go through the same entry a user's command takes (the launcher's `main` running an unmodified
Megatron script; the DeepSpeed script's `main`), as the fault matrix's bad-input cases do. The real-process
check (our script by plain torchrun on a `--save` another live run holds: every rank refuses with the same one
line, rank 1 on rank 0's verdict in torchrun's store) is in the fault matrix's `test_bad_input_through_real_processes`.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from dcp_megatron.config import DcpUsageError
from dcp_megatron.runtime import save_lock
from tests.support.deepspeed_runs import TINY_MODEL, ds_config, load_ds_script
from tests.support.megatron_runs import CPU_FLAGS, LLAMA_TINY
from tests.integration.test_fault_matrix import (DS_DCP, LONG_RUN, MEGATRON_DCP, MOE_EP2, _assert_refused,  # noqa: F401
                                     launch_refused_in_one_line, user_script)

pytestmark = pytest.mark.timeout(900)


# ------------------------------------------------------------------------------------------------- inputs

def _corpus(prefix, lengths: list[int]) -> str:
    """A megatron-core indexed dataset at `prefix` (one document per length; none for an empty list)."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=DType.optimal_dtype(256))
    rng = np.random.default_rng(len(lengths))
    for length in lengths:
        builder.add_document(rng.integers(0, 256, length).astype(np.uint8), [length])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def _mixed_pair(root) -> str:
    """A .bin from one corpus beside the .idx of another (the case upstream trains on silently)."""
    a, b = _corpus(root / "a", [300, 500]), _corpus(root / "b", [400, 200, 100])
    shutil.copy(f"{a}.idx", root / "mixed.idx")
    shutil.copy(f"{b}.bin", root / "mixed.bin")
    return str(root / "mixed")


def _live_lock(directory) -> dict:
    """A lock in `directory` held by a live process on this host (this test's parent) that is not this run."""
    os.makedirs(directory, exist_ok=True)
    holder = save_lock.LockHolder(host=socket.gethostname(), pid=os.getppid(),
                                  pid_start=save_lock._pid_start(os.getppid()), started="2026-12-02T07:00:00Z",
                                  token="another-run")
    with open(os.path.join(directory, save_lock.LOCK_FILE), "w") as f:
        json.dump(holder.__dict__, f)
    return holder.__dict__


def _held(directory) -> str:
    _live_lock(directory)
    return str(directory)


def _tracker(root, text: str) -> str:
    load = root / "ckpt"
    (load / "iter_0000002").mkdir(parents=True)
    (load / "latest_checkpointed_iteration.txt").write_text(text)
    return str(load)


def _ds_latest(root, tag: str) -> str:
    load = root / "ds_ckpt"
    (load / "iter_0000002").mkdir(parents=True)
    (load / "iter_0000002" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (load / "latest").write_text(tag)
    return str(load)


MEGATRON_CASES = {
    # Megatron's bare assertions, named by flag (also without --dcp)
    "save_without_interval": (lambda r: ["--save", str(r / "ckpt")], ["--save", "needs --save-interval"]),
    "global_batch_indivisible": (lambda r: ["--global-batch-size", "7"],
                                 ["--global-batch-size 7 is not divisible by --micro-batch-size 1 x data-parallel size 2"]),
    "eval_batch_indivisible": (lambda r: ["--eval-global-batch-size", "3"],
                               ["--eval-global-batch-size 3 is not divisible by --eval-micro-batch-size 1"]),
    "warmup_not_below_decay": (lambda r: ["--lr-warmup-iters", str(LONG_RUN)],
                               [f"--lr-warmup-iters {LONG_RUN} must be below --train-iters {LONG_RUN}"]),
    "seq_over_max_positions": (lambda r: ["--max-position-embeddings", "512"],
                               ["--seq-length 1024 is over --max-position-embeddings 512"]),
    # the corpus
    "blend_weight_zero": (lambda r: ["--data-path", "0", _corpus(r / "a", [300]), "1", _corpus(r / "b", [300])],
                          ["--data-path: blend weight 0", "must be a positive number"]),
    "blend_weight_negative": (lambda r: ["--data-path", "1", _corpus(r / "a", [300]), "-0.5", _corpus(r / "b", [300])],
                              ["--data-path: blend weight -0.5"]),
    "bin_of_another_corpus": (lambda r: ["--data-path", _mixed_pair(r)], ["mixed.bin holds", "mixed.idx describes",
                                                                          "do not belong together"]),
    "bin_of_another_corpus_in_blend": (lambda r: ["--data-path", "0.5", _corpus(r / "a", [300]), "0.5", _mixed_pair(r)],
                                       ["--data-path: ", "mixed.bin", "mixed.idx"]),
    "train_split_mismatched": (lambda r: ["--train-data-path", _mixed_pair(r), "--valid-data-path", _corpus(r / "v", [300]),
                                          "--test-data-path", _corpus(r / "t", [300])], ["--train-data-path: ", "mixed.bin"]),
    "empty_corpus": (lambda r: ["--data-path", _corpus(r / "empty", [])], ["empty corpus", "lists no documents"]),
    "idx_missing": (lambda r: ["--data-path", str(r / "nothing")], ["--data-path: ", "nothing.idx: no such file"]),
    # --dcp flags that cannot describe the job
    "gpus_per_node_zero": (lambda r: [*MEGATRON_DCP, "--dcp-gpus-per-node", "0"], ["--dcp-gpus-per-node must be >= 1"]),
    "gpus_per_node_not_dividing": (lambda r: [*MEGATRON_DCP, "--dcp-gpus-per-node", "3"],
                                   ["--dcp-gpus-per-node 3 does not describe this job", "2 ranks"]),
    "profile_is_a_directory": (lambda r: [*MEGATRON_DCP, "--dcp-profile", str(r)], ["--dcp-profile", "is a directory"]),
    # checkpoints: a second run on one --save; a tracker naming an iteration that is not there
    "save_held_by_live_run": (lambda r: [*MEGATRON_DCP, "--save", _held(r / "ckpt"), "--save-interval", "2"],
                              ["--save", "is held by another run", f"pid {os.getppid()}", "2026-12-02T07:00:00Z"]),
    "tracker_names_missing_iteration": (lambda r: [*MEGATRON_DCP, "--load", _tracker(r, "9")],
                                        ["--load", "latest_checkpointed_iteration.txt names iter_0000009",
                                         "does not exist", "iter_0000002"]),
    # sharded weights: refused under --dcp, by flag (layout_checks.py; docs/megatron.md gives the upstream reason)
    "megatron_fsdp": (lambda r: [*MEGATRON_DCP, "--use-megatron-fsdp", "--use-distributed-optimizer"],
                      ["--use-megatron-fsdp is not supported with --dcp", "DeepSpeed ZeRO-3"]),
    "torch_fsdp2": (lambda r: [*MEGATRON_DCP, "--use-torch-fsdp2"], ["--use-torch-fsdp2 is not supported with --dcp"]),
    "ckpt_step_missing": (lambda r: [*MEGATRON_DCP, "--load", _tracker(r, "2"), "--ckpt-step", "5"],
                          ["--ckpt-step 5 names iter_0000005"]),
    # issue 30, without --dcp: Megatron's bare assertion at step 1; flags upstream ignores or fails on later
    "seq_not_divisible_by_tp_sp": (lambda r: ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "1001"],
                                   ["--seq-length 1001 is not divisible by --tensor-model-parallel-size 2",
                                    "multiple of 2 (e.g. 1000)", "drop --sequence-parallel"]),
    "rampup_batch_size": (lambda r: ["--rampup-batch-size", "2", "2", "100"], ["--rampup-batch-size 2 2 100 is ignored"]),
    "tensorboard_not_writable": (lambda r: ["--tensorboard-dir", "/sys/dcp-tensorboard/run"], ["--tensorboard-dir", "/sys is not writable"]),
    "wandb_without_name": (lambda r: ["--wandb-project", "p", "--save", str(r / "ckpt"), "--save-interval", "2"],
                           ["--wandb-project p needs --wandb-exp-name"]),
    # issue 36: Megatron's AssertionError traceback on a world size TP x PP does not divide (these run as 2 ranks)
    "world_not_divisible_by_tp_pp": (lambda r: ["--pipeline-model-parallel-size", "3"],
                                     ["world size 2 is not divisible by TP 1 x PP 3 = 3", "run a multiple of 3 ranks"]),
    # issue 36: Megatron's recompute flags, which DCP's per-micro-batch switches would override
    "recompute_modules_with_dcp": (lambda r: [*MEGATRON_DCP, "--recompute-modules", "core_attn"],
                                   ["--recompute-modules core_attn conflicts with --dcp",
                                    "--dcp-recompute none,core_attn"]),
    "moe_layer_recompute_ep2": (lambda r: [*MEGATRON_DCP, *MOE_EP2, "--moe-layer-recompute"],
                                ["--moe-layer-recompute conflicts with --dcp",
                                 "--dcp-recompute moe is off under --expert-model-parallel-size 2"]),
}


@pytest.mark.parametrize("case", sorted(MEGATRON_CASES))
def test_megatron_start_check_refuses_in_one_line(case, user_script, tmp_path, monkeypatch, capsys):
    build, messages = MEGATRON_CASES[case]
    extra = build(tmp_path)
    # A run on files reads them instead of Megatron's mock data.
    base = [f for f in LLAMA_TINY if not (f == "--mock-data" and any(a.endswith("data-path") for a in extra))]
    launch_refused_in_one_line(monkeypatch, capsys, [user_script, *base, *CPU_FLAGS, "--train-iters", str(LONG_RUN),
                                                     *extra], messages)


DS_CASES = {
    "save_held_by_live_run": (lambda r: ["--dcp", "--save", _held(r / "ckpt")],
                              ["--save", "is held by another run", f"pid {os.getppid()}"]),
    "latest_names_missing_tag": (lambda r: [*DS_DCP, "--load", _ds_latest(r, "iter_0000009")],
                                 ["--load", "'latest' file names tag 'iter_0000009', which does not exist",
                                  "iter_0000002"]),
    "gpus_per_node_zero": (lambda r: ["--dcp", "--dcp-gpus-per-node", "0"], ["--dcp-gpus-per-node", "must be >= 1"]),
    "profile_is_a_directory": (lambda r: ["--dcp", "--dcp-profile", str(r)], ["dcp profile", "is a directory"]),
}


@pytest.mark.parametrize("case", sorted(DS_CASES))
def test_deepspeed_start_check_refuses_in_one_line(case, tmp_path, monkeypatch, capsys):
    import torch

    build, messages = DS_CASES[case]
    flags = build(tmp_path)
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(ds_config(stage=1, total_steps=LONG_RUN)))
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    code = load_ds_script().main([*TINY_MODEL, "--deepspeed-config", str(config), "--train-iters", str(LONG_RUN),
                                  *flags])
    out = capsys.readouterr()
    _assert_refused(code, out.err, out.out, messages, prefix="error: ")
    assert not torch.distributed.is_initialized(), "no process group may exist before a refused start"


@pytest.mark.parametrize("dcp", [[], MEGATRON_DCP], ids=["plain", "dcp"])
def test_gpu_only_and_missing_module_flags_refuse_in_one_line(dcp, user_script, tmp_path, monkeypatch, capsys):
    """--position-embedding-type yarn without a GPU (megatron-core's YaRN embedding moves its tables to CUDA in
    every forward) and --wandb-project without wandb (as on a machine where it is not installed)."""
    import importlib.util

    base = [user_script, *LLAMA_TINY, *CPU_FLAGS, "--train-iters", str(LONG_RUN), *dcp]
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    launch_refused_in_one_line(monkeypatch, capsys, [*base, "--position-embedding-type", "yarn"],
                               ["--position-embedding-type yarn needs a GPU", "rope"])
    launch_refused_in_one_line(monkeypatch, capsys, [*base, "--multi-latent-attention"],
                               ["--multi-latent-attention (its default --rope-type yarn) needs a GPU", "--rope-type rope"])
    # issue 36: megatron.training's bare AssertionError (offload) and "Found no NVIDIA driver" (grouped GEMM)
    launch_refused_in_one_line(monkeypatch, capsys, [*base, "--fine-grained-activation-offloading", "--offload-modules",
                                                     "core_attn"],
                               ["--fine-grained-activation-offloading --offload-modules needs a GPU"])
    launch_refused_in_one_line(monkeypatch, capsys, [*base, *MOE_EP2, "--moe-grouped-gemm"],
                               ["--moe-grouped-gemm needs a GPU"])
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    launch_refused_in_one_line(monkeypatch, capsys, [*base, "--wandb-project", "p", "--wandb-exp-name", "e",
                                                     "--wandb-save-dir", str(tmp_path)],
                               ["--wandb-project p: wandb is not installed"])


def test_eval_iters_without_eval_interval_is_refused_in_one_line(user_script, monkeypatch, capsys):
    """megatron.training 0.19.2 has no --eval-interval default and divides by it after the model is built (issue
    36); with --eval-iters 0 the run trains without evaluating instead (tests/unit/test_start_refusals.py)."""
    i = LLAMA_TINY.index("--eval-interval")
    base = [user_script, *LLAMA_TINY[:i], *LLAMA_TINY[i + 2:], *CPU_FLAGS, "--train-iters", str(LONG_RUN)]
    for dcp in ([], MEGATRON_DCP):
        launch_refused_in_one_line(monkeypatch, capsys, [*base, *dcp, "--eval-iters", "2"],
                                   ["--eval-iters 2 needs --eval-interval N", "--eval-iters 0"])


def test_deepspeed_fp16_on_a_cpu_without_fp16_kernels_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """DeepSpeed's CPU accelerator raised "Type fp16 is not supported on your device" once the engine was built."""
    import torch

    from dcp_megatron.deepspeed import config as ds_config_module

    monkeypatch.setattr(ds_config_module, "_cpu_has_fp16", lambda: False)   # as on this machine's CPUs
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(ds_config(stage=1, total_steps=LONG_RUN, fp16={"enabled": True})))
    code = load_ds_script().main([*TINY_MODEL, "--deepspeed-config", str(config), "--train-iters", str(LONG_RUN),
                                  "--dcp"])
    out = capsys.readouterr()
    _assert_refused(code, out.err, out.out, ['"fp16" is enabled in the DeepSpeed config', 'use "bf16"'],
                    prefix="error: ")
    assert not torch.distributed.is_initialized()


def test_deepspeed_train_batch_size_is_the_global_batch(tmp_path, monkeypatch, capsys):
    """One source of truth: the JSON's "train_batch_size" is --global-batch-size when the flag is not given (the
    disagreeing pair is the fault matrix's train_batch_size_disagrees case)."""
    from dcp_megatron.deepspeed.arguments import parse_args

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(ds_config(stage=1, total_steps=LONG_RUN, train_batch_size=6)))
    model = [f for i, f in enumerate(TINY_MODEL) if "--global-batch-size" not in TINY_MODEL[max(i - 1, 0):i + 1]]
    args = parse_args([*model, "--deepspeed-config", str(config), "--train-iters", str(LONG_RUN)])
    assert args.global_batch_size == 6
    assert '"train_batch_size": 6 is the global batch' in capsys.readouterr().out
    args = parse_args([*model, "--global-batch-size", "6", "--deepspeed-config", str(config), "--train-iters", "9"])
    assert args.global_batch_size == 6


def test_deepspeed_megatron_optimizer_flags_reach_the_engines_json(tmp_path, monkeypatch):
    """--lr, --adam-beta2, --clip-grad and --optimizer sgd through the script's own parse and set-up: written into
    the JSON the engine gets (the disagreeing pair is the fault matrix's megatron_lr_flag case)."""
    from dcp_megatron.deepspeed.arguments import parse_args
    from dcp_megatron.deepspeed.setup import deepspeed_setup

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    config = dict(ds_config(stage=1, total_steps=LONG_RUN))
    del config["optimizer"], config["gradient_clipping"]
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    flags = [*TINY_MODEL, "--deepspeed-config", str(path), "--train-iters", "9"]
    args = parse_args([*flags, "--lr", "2e-4", "--adam-beta2", "0.95", "--clip-grad", "0.5"])
    ds, _ = deepspeed_setup(args, has_gpu=False)
    assert ds["optimizer"]["type"] == "AdamW" and ds["gradient_clipping"] == 0.5
    assert {k: ds["optimizer"]["params"][k] for k in ("lr", "betas")} == {"lr": 2e-4, "betas": [0.9, 0.95]}
    ds, _ = deepspeed_setup(parse_args([*flags, "--optimizer", "sgd", "--lr", "0.1"]), has_gpu=False)
    assert ds["optimizer"] == {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}   # Megatron's SGD momentum


def test_empty_iteration_directories_of_interrupted_saves_are_removed_at_start(tmp_path, capsys, monkeypatch):
    """A save killed before it wrote leaves an empty iter_* (Megatron makes the directory first): removed at the
    next start by rank 0, never the tracker's iteration; a non-empty newer one is named, not touched."""
    from dcp_megatron.training.checkpoints import clear_interrupted_saves

    save = tmp_path / "ckpt"
    for name in ("iter_0000002", "iter_0000003/sub", "iter_0000004", "iter_0000005"):
        (save / name).mkdir(parents=True)
    (save / "iter_0000002" / "__0_0.distcp").write_bytes(b"x")
    (save / "iter_0000005" / "__0_0.distcp").write_bytes(b"x")
    (save / "latest_checkpointed_iteration.txt").write_text("4")   # (an empty tracked one stays: Megatron's)
    assert clear_interrupted_saves(str(save), rank=1) == [] and (save / "iter_0000003").exists()
    assert clear_interrupted_saves(str(save), rank=0) == ["iter_0000003"]
    assert sorted(p.name for p in save.iterdir() if p.is_dir()) == ["iter_0000002", "iter_0000004", "iter_0000005"]
    out = capsys.readouterr().out
    assert "removed iter_0000003 from --save" in out and "iter_0000005 in --save" in out and "newer than" in out
    # the start-up path (patched validate_args -> check_run_paths) does it, after taking the --save lock
    import types

    from dcp_megatron.training.checks.run_paths import check_run_paths

    (save / "iter_0000006").mkdir()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    check_run_paths(types.SimpleNamespace(save=str(save), tensorboard_dir=None, dcp_dump_plans=None, load=None,
                                          rank=0))
    assert not (save / "iter_0000006").exists() and (save / save_lock.LOCK_FILE).exists()


# ----------------------------------------------------------------------------------------- the pieces

def test_gpus_per_node_must_match_torchruns_ranks_per_node(monkeypatch):
    from dcp_megatron.config import check_gpus_per_node

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(DcpUsageError, match="3 does not describe this job: torchrun runs 2 ranks per node"):
        check_gpus_per_node(3)
    with pytest.raises(DcpUsageError, match="4 does not describe"):
        check_gpus_per_node(4)   # divides the world, but torchrun says 2 per node
    check_gpus_per_node(2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    check_gpus_per_node(4)
    with pytest.raises(DcpUsageError, match="not a whole number of nodes of 3"):
        check_gpus_per_node(3)


def test_corpus_check_accepts_a_matching_pair_and_names_a_truncated_bin(tmp_path):
    from dcp_megatron.flags.data_files import check_indexed_pair

    prefix = _corpus(tmp_path / "c", [300, 500, 70])
    check_indexed_pair(prefix, "--data-path")
    whole = os.path.getsize(f"{prefix}.bin")
    with open(f"{prefix}.bin", "r+b") as f:
        f.truncate(whole - 1)   # one byte short
    with pytest.raises(DcpUsageError, match=rf"c.bin holds {whole - 1} bytes but .*c.idx describes {whole} "):
        check_indexed_pair(prefix, "--data-path")


def test_save_lock_is_exclusive_while_its_holder_lives_and_stale_after(tmp_path):
    first = save_lock.SaveDirLock(str(tmp_path / "ckpt")).acquire()
    again = save_lock.SaveDirLock(str(tmp_path / "ckpt")).acquire()   # the holding process itself may
    first.release()
    assert os.path.exists(again.path), "a released lock that was taken over stays with its new holder"
    again.release()
    assert not os.path.exists(again.path), "release removes the lock"
    _live_lock(tmp_path / "ckpt")   # held by the live parent process
    with pytest.raises(save_lock.SaveDirInUse, match=rf"held by another run \(host .*pid {os.getppid()}"):
        save_lock.SaveDirLock(str(tmp_path / "ckpt")).acquire()
    # A crashed run on this host: its pid is gone.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    holder = dict(_live_lock(tmp_path / "ckpt"), pid=dead.pid, pid_start=None)
    (tmp_path / "ckpt" / save_lock.LOCK_FILE).write_text(json.dumps(holder))
    resumed = save_lock.SaveDirLock(str(tmp_path / "ckpt")).acquire()
    assert json.loads(open(resumed.path).read())["token"] == resumed.holder.token
    resumed.release()
    # A live pid that is another process now (its start time differs): stale too.
    _live_lock(tmp_path / "ckpt")
    holder = dict(json.loads((tmp_path / "ckpt" / save_lock.LOCK_FILE).read_text()), pid_start="1")
    (tmp_path / "ckpt" / save_lock.LOCK_FILE).write_text(json.dumps(holder))
    save_lock.SaveDirLock(str(tmp_path / "ckpt")).acquire().release()


def test_save_lock_of_another_host_is_stale_only_once_it_stops_being_refreshed(tmp_path):
    path = tmp_path / save_lock.LOCK_FILE
    holder = save_lock.LockHolder(host="other-node", pid=1, pid_start=None, started="t", token="x")
    path.write_text(json.dumps(holder.__dict__))
    with pytest.raises(save_lock.SaveDirInUse, match="host other-node, pid 1"):
        save_lock.SaveDirLock(str(tmp_path)).acquire()
    old = time.time() - save_lock.STALE_AFTER_S - 1
    os.utime(path, (old, old))
    save_lock.SaveDirLock(str(tmp_path)).acquire().release()


def test_only_rank_zero_takes_the_save_lock(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert save_lock.hold_save_dir(str(tmp_path / "a"), rank=1) is None
    assert not (tmp_path / "a" / save_lock.LOCK_FILE).exists()
    lock = save_lock.hold_save_dir(str(tmp_path / "a"), rank=0)
    assert (tmp_path / "a" / save_lock.LOCK_FILE).exists()
    lock.release()


def test_every_rank_follows_rank_zeros_verdict_through_torchruns_store(tmp_path, monkeypatch):
    """Rank 0 alone reads and takes the lock; the other ranks get its verdict from the rendezvous store (here a real
    TCPStore in this process, as torchrun's agent hosts one), so the whole job refuses, or starts, together."""
    from datetime import timedelta

    import torch.distributed as dist

    from tests.support.dist_utils import free_port

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("WORLD_SIZE", "2"),
                        ("TORCHELASTIC_USE_AGENT_STORE", "True"), ("TORCHELASTIC_RESTART_COUNT", "0")):
        monkeypatch.setenv(name, value)
    held = _held(tmp_path / "held")
    with pytest.raises(save_lock.SaveDirInUse) as on_rank0:
        save_lock.hold_save_dir(held, rank=0)
    with pytest.raises(save_lock.SaveDirInUse) as on_rank1:
        save_lock.hold_save_dir(str(tmp_path / "anything"), rank=1)   # rank 1 does not look: it follows rank 0
    assert str(on_rank1.value) == str(on_rank0.value) and "is held by another run" in str(on_rank1.value)
    # A restarted job (torchrun's restart count) asks afresh: a free directory, taken by rank 0, accepted by rank 1.
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    lock = save_lock.hold_save_dir(str(tmp_path / "free"), rank=0)
    assert save_lock.hold_save_dir(str(tmp_path / "free"), rank=1) is None
    lock.release()
    del store


def test_a_refusal_at_the_first_step_ends_in_one_line_too(monkeypatch, capsys):
    """A check that needs the built tokenizer raises DcpUsageError inside Megatron's train(): the patched
    train() ends the process with one line and exit 2 (a plain-torchrun script has no frame that would)."""
    import types

    import megatron.training
    import torch

    from dcp_megatron.config import DcpUsageError
    from patches import training_training

    run_args = types.SimpleNamespace(dcp=True, curr_iteration=0, distributed_timeout_minutes=1.0)
    monkeypatch.setattr(megatron.training, "get_args", lambda: run_args)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 1)
    monkeypatch.setattr("dcp_megatron.runtime.heartbeat.connect_store", lambda: None)

    def first_step_refuses(*args, **kwargs):
        raise DcpUsageError("--seq-length 4096 fits no CP group under --dcp-memory-budget-gb 0.001")

    with pytest.raises(SystemExit) as exited:
        no_device = types.SimpleNamespace(dcp=types.SimpleNamespace(device_memory_gb=None))
        training_training._with_timeout_report(first_step_refuses, types.SimpleNamespace(
            spec_of=lambda _: no_device))(lambda: None, [])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["dcp: error: --seq-length 4096 fits no CP group under --dcp-memory-budget-gb 0.001"]


def test_token_ids_past_a_built_tokenizer_end_in_one_line_before_step_1(monkeypatch, capsys, tmp_path):
    """Issue 46: a tokenizer other than NullTokenizer is known once Megatron's initialize built it; the patched
    train() checks the corpus against its padded vocabulary before the loop runs, one line and exit 2."""
    import types

    import megatron.training
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from patches import training_training

    prefix = str(tmp_path / "corpus")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    builder.add_document(torch.tensor([5, 300, 7], dtype=torch.uint16), [3])
    builder.finalize(prefix + ".idx")
    run_args = types.SimpleNamespace(dcp=True, curr_iteration=0, distributed_timeout_minutes=1.0,
                                     tokenizer_type="GPT2BPETokenizer", padded_vocab_size=256, data_path=[prefix],
                                     mock_data=False, data_args_path=None, per_split_data_args_path=None,
                                     train_data_path=None, valid_data_path=None, test_data_path=None)
    monkeypatch.setattr(megatron.training, "get_args", lambda: run_args)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 1)
    monkeypatch.setattr("dcp_megatron.runtime.heartbeat.connect_store", lambda: None)
    ran = []
    no_device = types.SimpleNamespace(dcp=types.SimpleNamespace(device_memory_gb=None))
    train = training_training._with_timeout_report(lambda *a, **k: ran.append(1),
                                                   types.SimpleNamespace(spec_of=lambda _: no_device))
    with pytest.raises(SystemExit) as exited:
        train(lambda: None, [])
    assert exited.value.code == 2 and not ran
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds token id 300" in err[0] and "--tokenizer-type GPT2BPETokenizer" in err[0], err
    run_args.padded_vocab_size = 512   # a vocabulary that holds the corpus: the loop runs
    train(lambda: None, [])
    assert ran == [1]
