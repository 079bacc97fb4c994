"""DeepSpeed checkpoints of a run: DeepSpeed's own files, with the iteration and data position inside.

`engine.save_checkpoint(dir, tag, client_state)` writes the model, optimizer and scheduler states
and the `latest` tag file; our client state adds the iteration and the data stream's position (the
first global batch not trained yet), so a resumed run trains exactly the batches an uninterrupted
one would. After each save, a checksum manifest of the tag directory (dcp_megatron/runtime/
checkpoint_manifest.py) with the run's optimizer and scheduler blocks.

Checked at start (before any process group): a `--save` that is a file or not writable would otherwise
fail at the first save, after training; a `--load` without a checkpoint would make DeepSpeed warn and
train from scratch; the checkpoint `latest` names is verified against its manifest (a flipped byte or a
truncated file stops the run naming the file), its ZeRO layout against this run's stage (recorded in the
manifest; else read from the file names) and its ZeRO partitions against this run's world size;
changed optimizer/scheduler settings are refused unless
`--override-optimizer-config` asks for them: DeepSpeed would silently keep the checkpoint's
hyperparameters in the optimizer's param groups (the learning rate until the scheduler's next step,
betas and weight decay for good).
"""
from __future__ import annotations

import glob
import os

from dcp_megatron.config import DcpUsageError
from dcp_megatron.deepspeed.config import zero_stage
from dcp_megatron.flags.run_paths import check_resume_dir, check_writable_dir, hold_save_dir_or_refuse
from dcp_megatron.runtime import checkpoint_manifest as manifest_io

LATEST_FILE = "latest"   # DeepSpeed's tag file
_CLIENT_KEY = "dcp_megatron"


def holds_deepspeed_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, LATEST_FILE)) or bool(glob.glob(os.path.join(path, "*", "*model_states.pt")))


def check_checkpoint_paths(*, save: str | None, load: str | None, dump_plans: str | None) -> None:
    for flag, path in (("--save", save), ("--dcp-dump-plans", dump_plans)):
        if path:
            check_writable_dir(path, flag)
    # --load the --save directory with nothing saved yet: the first start of a run under torchrun --max-restarts
    # (each restart resumes from what the run saved since); training starts from scratch, as Megatron does
    if load and not (save and os.path.realpath(load) == os.path.realpath(save) and not has_latest(load)):
        check_resume_dir(load, holds=holds_deepspeed_checkpoint,
                         expected=f"DeepSpeed checkpoint (no '{LATEST_FILE}' file and no <tag>/*model_states.pt)")
    if save:
        hold_save_dir_or_refuse(save)   # last: one run per checkpoint directory


def has_latest(load: str) -> bool:
    """Whether `load` names a checkpoint to resume (its `latest` file)."""
    return os.path.isfile(os.path.join(load, LATEST_FILE))


def optimizer_settings(ds_config: dict) -> dict:
    """What a resumed run must agree on with its checkpoint (the config's optimizer and scheduler blocks; the
    torch_adam switch the script sets on CPU is an implementation choice, not a setting)."""
    optimizer = dict(ds_config.get("optimizer") or {})
    if "params" in optimizer:
        optimizer["params"] = {k: v for k, v in optimizer["params"].items() if k != "torch_adam"}
    return {"optimizer": optimizer or None, "scheduler": ds_config.get("scheduler")}


def check_resume(load: str, ds_config: dict, *, override: bool, rank: int, world_size: int) -> None:
    """Verify the checkpoint `latest` in `load` names; refuse changed optimizer settings unless `override`."""
    tag_file = os.path.join(load, LATEST_FILE)
    if not os.path.isfile(tag_file):
        return   # DeepSpeed names what it cannot find; check_checkpoint_paths made sure a checkpoint is there
    with open(tag_file) as f:
        tag = f.read().strip()
    directory = os.path.join(load, tag)
    if not tag or not os.path.isdir(directory):
        # DeepSpeed would fail on it only after building the engine (an assertion or FileNotFoundError).
        saved = sorted(os.path.basename(os.path.dirname(p)) for p in glob.glob(os.path.join(load, "*", "*model_states.pt")))
        raise DcpUsageError(f"--load {load}: its '{LATEST_FILE}' file names tag {tag!r}, which does not exist; write a "
                            f"saved tag into it ({', '.join(sorted(set(saved))[-3:]) or 'none is saved there'}) or "
                            f"fix --load")
    try:
        manifest = manifest_io.read_and_verify(directory, rank=rank, world_size=world_size)
    except manifest_io.CheckpointError as err:
        raise DcpUsageError(f"--load {load}: {err}") from err
    check_zero_stage(load, directory, ds_config, saved_stage=None if manifest is None else
                     manifest["settings"].get("zero_stage"))
    if manifest is None:
        if rank == 0:
            print(f"{directory} has no checksum manifest ({manifest_io.MANIFEST_FILE}): loaded unverified", flush=True)
        return
    saved, now = manifest["settings"].get("deepspeed"), optimizer_settings(ds_config)
    changed = [key for key in now if saved is not None and saved.get(key) != now[key]]
    if changed and not override:
        listed = "; ".join(f'"{key}" {now[key]} (checkpoint: {saved.get(key)})' for key in changed)
        raise DcpUsageError(
            f"--load {load}: the DeepSpeed config's optimizer/scheduler settings changed since the checkpoint: "
            f"{listed}. DeepSpeed would keep the checkpoint's values in the optimizer; add --override-optimizer-config "
            f"to train with the new ones (optimizer moments are kept), or restore the old values")
    check_zero_world_size(load, directory, ds_config, world_size=world_size)
    if rank == 0:
        note = f"; following the new {', '.join(changed)} settings" if changed else ""
        print(f"{directory} verified against its checksum manifest ({len(manifest['files'])} files){note}",
              flush=True)


def check_zero_world_size(load: str, directory: str, ds_config: dict, *, world_size: int) -> None:
    """ZeRO 1-3 save one optimizer partition per data-parallel rank; DeepSpeed 0.19.8 loads them only on as many
    ranks (`ZeRORuntimeException` in engine._load_zero_checkpoint, after the engine is built)."""
    zero = ds_config.get("zero_optimization") or {}
    if zero.get("stage", 0) not in (1, 2, 3) or (ds_config.get("checkpoint") or {}).get("load_universal"):
        return
    saved_ranks = len(glob.glob(os.path.join(directory, "*zero_pp_rank_*_mp_rank_00_optim_states.pt")))
    if saved_ranks and saved_ranks != world_size:
        raise DcpUsageError(f"--load {load}: {os.path.basename(directory)}'s ZeRO optimizer state is partitioned over "
                            f"{saved_ranks} data-parallel ranks and this run has {world_size}; DeepSpeed cannot "
                            f"re-partition it: resume on {saved_ranks} ranks")


# ZeRO stages whose checkpoints DeepSpeed 0.19.8 loads into each other (1 and 2 partition the optimizer alike)
_STAGE_LAYOUTS = {0: "no ZeRO", 1: "ZeRO 1-2", 2: "ZeRO 1-2", 3: "ZeRO-3"}


def saved_zero_stage(directory: str) -> int:
    """The ZeRO stage a tag directory's files were written under, as far as their names tell: 3 (every rank's
    weight partition, `zero_pp_rank_*_model_states.pt`), 1 for stages 1-2 (optimizer partitions beside one
    `mp_rank_*_model_states.pt`), 0 (neither)."""
    if glob.glob(os.path.join(directory, "zero_pp_rank_*_mp_rank_*_model_states.pt")):
        return 3
    return 1 if glob.glob(os.path.join(directory, "*zero_pp_rank_*_mp_rank_*_optim_states.pt")) else 0


def check_zero_stage(load: str, directory: str, ds_config: dict, *, saved_stage: int | None = None) -> None:
    """A checkpoint of another ZeRO layout does not load: a ZeRO-3 one under stage 0-2 ends in a bare AssertionError
    in DeepSpeed's state_dict_factory, a stage 0-2 one under stage 3 finds no weight partitions, a stage 1-2 one
    under stage 0 has no optimizer state in its model file, and a stage 0 one under stage 1-2 trains on with a
    fresh optimizer. `saved_stage`: the stage the manifest recorded (else the file names tell the layout)."""
    now = (ds_config.get("zero_optimization") or {}).get("stage", 0)
    if (ds_config.get("checkpoint") or {}).get("load_universal") or now not in _STAGE_LAYOUTS:
        return
    layout = saved_zero_stage(directory)
    if _STAGE_LAYOUTS[layout] == _STAGE_LAYOUTS[now]:
        return
    exact = saved_stage if _STAGE_LAYOUTS.get(saved_stage) == _STAGE_LAYOUTS[layout] else None
    saved = str(exact) if exact is not None else ("1 or 2" if layout == 1 else str(layout))
    raise DcpUsageError(f"--load {load}: {os.path.basename(directory)} was saved under ZeRO stage {saved} and the "
                        f"DeepSpeed config asks for stage {now}: DeepSpeed cannot load one stage's files into the "
                        f"other's layout; resume with \"zero_optimization\": {{\"stage\": {saved}}}, or train "
                        "without --load")


class SaveFailed(RuntimeError):
    """A save that could not be written (a full disk); the message says what, where, and what is kept."""


def _failed_save_message(directory: str, tag: str, err: OSError) -> str:
    """Remove the partial tag directory (`latest` never named it: it moves only after the manifest) and say why."""
    import shutil

    partial = os.path.join(directory, tag)
    shutil.rmtree(partial, ignore_errors=True)
    try:
        with open(os.path.join(directory, LATEST_FILE)) as f:
            kept = f"the latest checkpoint stays {f.read().strip()}"
    except OSError:
        kept = "no earlier checkpoint exists"
    where = f" writing {err.filename}" if err.filename else ""
    return (f"saving the checkpoint to --save {directory} failed: {err.strerror or err} (errno {err.errno}){where}; "
            f"removed the partial {partial}; {kept}. Free space (or give another --save), then resume with "
            f"--load {directory}")


def tag_of(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def save(engine, directory: str, *, iteration: int, data_state: dict, ds_config: dict) -> None:
    """A collective: every rank calls it (ZeRO ranks write their own optimizer shards). `latest` moves to the new
    tag only once its manifest is written, so the latest checkpoint always has one."""
    import torch.distributed as dist

    tag = tag_of(iteration)
    try:
        engine.save_checkpoint(directory, tag=tag, save_latest=False,
                               client_state={_CLIENT_KEY: {"iteration": iteration, "data": data_state}})
        manifest_io.record(os.path.join(directory, tag), {"deepspeed": optimizer_settings(ds_config),
                                                          "zero_stage": zero_stage(ds_config)})
    except OSError as err:
        raise SaveFailed(_failed_save_message(directory, tag, err)) from err
    if dist.get_rank() == 0:
        manifest_io.write_atomically(os.path.join(directory, LATEST_FILE), tag)
    dist.barrier()


def load(engine, directory: str, *, apply_config: bool) -> tuple[int, dict]:
    """(iteration trained, data position) of the latest checkpoint in `directory` (a collective).

    `apply_config`: after loading, the optimizer's hyperparameters are the config's (as built), not the
    checkpoint's, and the scheduler re-sets the learning rate for the resumed iteration."""
    groups = engine.optimizer.param_groups
    configured = [{k: v for k, v in group.items() if k != "params"} for group in groups]
    path, client_state = engine.load_checkpoint(directory)
    if path is None:
        raise DcpUsageError(f"--load {directory}: DeepSpeed found no loadable checkpoint there")
    ours = (client_state or {}).get(_CLIENT_KEY)
    if not isinstance(ours, dict) or not {"iteration", "data"} <= set(ours):
        raise DcpUsageError(f"--load {directory}: checkpoint {path} was not written by this script (no data position "
                            "in its client state), so the run cannot continue its data where it stopped")
    scheduler = engine.lr_scheduler
    if apply_config:
        for group, values in zip(engine.optimizer.param_groups, configured):
            group.update({k: v for k, v in values.items() if k not in ("step", "initial_lr")})
        if scheduler is not None and hasattr(scheduler, "last_batch_iteration"):
            scheduler.step(scheduler.last_batch_iteration)   # the new schedule's rate at the resumed iteration
    if hasattr(scheduler, "reapply"):   # Megatron's scheduler (lr_schedule.py): its rate, not the saved groups'
        scheduler.reapply()
    return int(ours["iteration"]), ours["data"]
