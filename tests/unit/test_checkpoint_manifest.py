"""Units of the fault handling: checksum manifests, resume checks that let a run through (the refusals are in
test_fault_matrix.py), and the heartbeat that names a stopped rank."""
from __future__ import annotations

import argparse
import json
import threading
import time
from datetime import timedelta

import pytest

from dcp_megatron.runtime import checkpoint_manifest as manifest_io
from dcp_megatron.runtime.heartbeat import Heartbeat, describe_silence, is_collective_timeout
from tests.support.dist_utils import free_port


def _checkpoint(tmp_path, files: dict[str, bytes], settings: dict | None = None):
    for name, data in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    paths = manifest_io.checkpoint_files(str(tmp_path))
    manifest_io.write_manifest(str(tmp_path), manifest_io.digests_of(str(tmp_path), paths), settings or {})
    return manifest_io.read_manifest(str(tmp_path))


def test_every_file_is_hashed_by_exactly_one_rank_and_verified(tmp_path):
    files = {f"shard_{i}.bin": bytes([i]) * (100 + i) for i in range(7)}
    files["sub/common.pt"] = b"common"
    manifest = _checkpoint(tmp_path, files)
    assert sorted(manifest["files"]) == sorted(files)
    for world_size in (1, 2, 3):
        shares = [manifest_io.share_of(sorted(files), rank=r, world_size=world_size) for r in range(world_size)]
        assert sorted(sum(shares, [])) == sorted(files)
        for rank in range(world_size):
            manifest_io.verify(str(tmp_path), manifest, rank=rank, world_size=world_size)
    # A flipped byte is found by the rank whose share holds the file, and only there.
    data = bytearray(files["shard_3.bin"])
    data[5] ^= 1
    (tmp_path / "shard_3.bin").write_bytes(bytes(data))
    owner = sorted(files).index("shard_3.bin") % 2
    with pytest.raises(manifest_io.CheckpointError, match="shard_3.bin does not match its saved checksum"):
        manifest_io.verify(str(tmp_path), manifest, rank=owner, world_size=2)
    manifest_io.verify(str(tmp_path), manifest, rank=1 - owner, world_size=2)
    # Sizes are checked on every rank.
    (tmp_path / "sub" / "common.pt").write_bytes(b"")
    with pytest.raises(manifest_io.CheckpointError, match="common.pt has 0 bytes, 6 were saved"):
        manifest_io.verify(str(tmp_path), manifest, rank=1 - owner, world_size=2)


def test_manifest_is_written_atomically_and_a_bad_one_is_named(tmp_path):
    _checkpoint(tmp_path, {"a": b"x"})
    assert not list(tmp_path.glob("*.dcp_tmp"))
    assert manifest_io.read_manifest(str(tmp_path / "nowhere")) is None
    (tmp_path / manifest_io.MANIFEST_FILE).write_text(json.dumps({"format": 99, "files": {}}))
    with pytest.raises(manifest_io.CheckpointError, match="unreadable checksum manifest"):
        manifest_io.read_manifest(str(tmp_path))


def _megatron_args(load, **overrides):
    args = dict(load=load, ckpt_step=None, rank=0, world_size=1, dcp=True, finetune=False, no_load_optim=False,
                use_distributed_optimizer=True, override_opt_param_scheduler=False,
                use_checkpoint_opt_param_scheduler=False, lr=1e-3, min_lr=1e-4, train_iters=10, train_samples=None,
                global_batch_size=8, lr_decay_iters=None, lr_decay_samples=None, lr_warmup_iters=2,
                lr_warmup_samples=0, lr_warmup_fraction=None, lr_decay_style="cosine", start_weight_decay=0.1,
                end_weight_decay=0.1, weight_decay_incr_style="constant")
    args.update(overrides)
    return argparse.Namespace(**args)


def test_megatron_resume_follows_the_upstream_flag_that_asks_for_it(tmp_path, capsys):
    from dcp_megatron.training.checkpoints import check_resume, schedule_settings
    from dcp_megatron.config import DcpUsageError

    saved = _megatron_args(str(tmp_path))
    _checkpoint(tmp_path / "iter_0000005", {"__0_0.distcp": b"w" * 64}, {"megatron": schedule_settings(saved)})
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5")
    check_resume(_megatron_args(str(tmp_path)))
    assert "verified against its checksum manifest (1 files)" in capsys.readouterr().out
    with pytest.raises(DcpUsageError, match="--override-opt_param-scheduler"):
        check_resume(_megatron_args(str(tmp_path), train_iters=20))
    # An explicit --lr-decay-iters equal to the old run length keeps the decay; weight-decay steps still change.
    with pytest.raises(DcpUsageError, match="wd_incr_steps 160"):
        check_resume(_megatron_args(str(tmp_path), train_iters=20, lr_decay_iters=10))
    check_resume(_megatron_args(str(tmp_path), train_iters=20, override_opt_param_scheduler=True))
    assert "following the flags (--override-opt_param-scheduler)" in capsys.readouterr().out
    check_resume(_megatron_args(str(tmp_path), train_iters=20, use_checkpoint_opt_param_scheduler=True))
    assert "the checkpoint's schedule (--use-checkpoint-opt_param-scheduler)" in capsys.readouterr().out
    # A new learning rate: the distributed optimizer's state cannot load; without it Megatron's override applies.
    with pytest.raises(DcpUsageError, match="--no-load-optim"):
        check_resume(_megatron_args(str(tmp_path), lr=2e-3, override_opt_param_scheduler=True))
    check_resume(_megatron_args(str(tmp_path), lr=2e-3, use_distributed_optimizer=False,
                                override_opt_param_scheduler=True))
    check_resume(_megatron_args(str(tmp_path), lr=2e-3, no_load_optim=True))   # nothing of the schedule is loaded
    check_resume(_megatron_args(str(tmp_path), lr=2e-3, finetune=True))


def test_deepspeed_resume_with_changed_settings_needs_the_override(tmp_path, capsys):
    from dcp_megatron.deepspeed.checkpoint import check_resume, optimizer_settings
    from dcp_megatron.config import DcpUsageError

    config = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}}
    _checkpoint(tmp_path / "iter_0000003", {"model_states.pt": b"m" * 10}, {"deepspeed": optimizer_settings(config)})
    (tmp_path / "latest").write_text("iter_0000003")
    gpu_config = {**config, "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}}   # torch_adam is not a setting
    check_resume(str(tmp_path), gpu_config, override=False, rank=0, world_size=1)
    changed = {**config, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    with pytest.raises(DcpUsageError, match="--override-optimizer-config"):
        check_resume(str(tmp_path), changed, override=False, rank=0, world_size=1)
    capsys.readouterr()
    check_resume(str(tmp_path), changed, override=True, rank=0, world_size=1)
    assert "following the new optimizer settings" in capsys.readouterr().out


def test_heartbeat_names_the_rank_that_stopped_beating():
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, timeout=timedelta(seconds=10),
                          wait_for_workers=False)
    steps = {0: 7, 1: 7, 2: 5, 4: 7, 5: 8}
    # interval 10 s: every beat after the first is a step change, recorded at once (poll_s)
    beats = {r: Heartbeat(store, rank=r, world_size=6, step_of=lambda r=r: steps[r], interval_s=10.0,
                          poll_s=0.01).start() for r in steps}   # rank 3 never starts
    steps[1] = 8                  # finishes step 7, starts step 8 ...
    time.sleep(0.3)
    beats[1].close()              # ... and stops beating at once, as a SIGSTOPped process would
    time.sleep(0.1)

    def next_step():              # the live ones keep beating (here: a new step each, during the check)
        for r in (0, 2, 4, 5):
            steps[r] += 1

    threading.Timer(0.1, next_step).start()
    silent = beats[0].silent_ranks(my_step=8, intervals=0.04)   # reads, waits 0.4 s, reads again
    for beat in beats.values():
        beat.close()
    by_rank = {s.rank: s for s in silent}
    assert sorted(by_rank) == [1, 2, 3]                        # ranks 4 (live, same step) and 5 (ahead): fine
    assert by_rank[1].stopped and by_rank[1].step == 8         # the step it really reached, not its first beat's
    assert not by_rank[2].stopped and by_rank[2].step == 6     # alive, but behind
    assert by_rank[3].stopped and by_rank[3].step is None      # never heard
    text = describe_silence(silent)
    assert "rank 1 (stopped or dead" in text and "rank 2 (alive but behind" in text and "rank 3" in text
    assert is_collective_timeout(RuntimeError("[gloo] Timed out waiting 30000ms for recv operation to complete"))
    assert not is_collective_timeout(RuntimeError("Connection reset by peer"))


def test_a_torch_dist_checkpoint_resumed_with_ckpt_format_torch_is_refused(tmp_path):
    """megatron-core 0.19.2 fails on it after building the model; a torch-format checkpoint loads either way."""
    from dcp_megatron.training.checkpoints import check_resume
    from dcp_megatron.config import DcpUsageError

    dist = tmp_path / "dist"
    (dist / "iter_0000003").mkdir(parents=True)
    (dist / "iter_0000003" / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    (dist / "latest_checkpointed_iteration.txt").write_text("3")
    with pytest.raises(DcpUsageError, match="iter_0000003 is a torch_dist checkpoint and --ckpt-format is torch.*"
                                            "resume with --ckpt-format torch_dist"):
        check_resume(_megatron_args(str(dist), dcp=False, ckpt_format="torch"))
    check_resume(_megatron_args(str(dist), dcp=False, ckpt_format="torch_dist"))
    legacy = tmp_path / "legacy"
    (legacy / "iter_0000003" / "mp_rank_00").mkdir(parents=True)
    (legacy / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"x")
    (legacy / "latest_checkpointed_iteration.txt").write_text("3")
    for ckpt_format in ("torch", "torch_dist"):
        check_resume(_megatron_args(str(legacy), dcp=False, ckpt_format=ckpt_format))
