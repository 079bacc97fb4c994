"""Checkpoints of megatron.training runs under our patches: no save of non-finite weights, a checksum
manifest after each save, and the checkpoint to resume checked at start-up (before any process group or model).

- Before `save_checkpoint`, every rank checks its weights are finite (one all-reduce): megatron-core's
  NaN check stops the run at a non-finite loss, but first saves the state it stopped in (to diagnose it),
  which after a step at `--lr inf` already holds Inf weights and would become the latest checkpoint to
  resume; and without `--save` that save fails with a TypeError. Such a save is skipped, saying so, and
  Megatron's check ends the run with its own exit code.

- After `save_checkpoint` (persistent, synchronous saves of `--dcp` runs) every rank hashes its share of
  the iteration directory and rank 0 writes the manifest (dcp_megatron/runtime/checkpoint_manifest.py),
  with the run's learning-rate schedule flags.
- At start-up, the checkpoint `--load` resolves to (its tracker's iteration, or `--ckpt-step`) is
  verified against its manifest: every file's size, and this rank's share of the hashes, so a flipped
  byte or a truncated file stops the run naming the file instead of loading silently or failing inside
  torch. Its schedule flags are compared with this run's: megatron-core 0.19.2 fails on a changed
  schedule only while loading, with an assertion (`--train-iters`, warm-up, decay) or a KeyError inside
  the distributed optimizer (`--lr`, `--min-lr`), after the model is built. Here the user is told which
  flag changed and which upstream flag makes Megatron follow the new value. A `torch_dist` checkpoint resumed
  with `--ckpt-format torch` is refused (megatron-core 0.19.2 stops after building the model: "neither
  --use-dist-ckpt nor --auto-detect-ckpt-format is set", and with `--auto-detect-ckpt-format` a KeyError 'model').
  The other way round loads: a `torch_dist` run reads a `torch`-format checkpoint.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil

from dcp_megatron.config import DcpUsageError
from dcp_megatron.runtime import checkpoint_manifest as manifest_io

# Megatron's checkpoint tracker file (megatron.training.checkpointing.get_checkpoint_tracker_filename).
TRACKER_FILE = "latest_checkpointed_iteration.txt"

# The values megatron-core 0.19.2's OptimizerParamScheduler checks on load (as get_optimizer_param_scheduler
# derives them from the flags) and the flags each comes from.
SCHEDULE_VALUES = {
    "max_lr": ("--lr",), "min_lr": ("--min-lr",),
    "lr_warmup_steps": ("--lr-warmup-iters", "--lr-warmup-samples", "--lr-warmup-fraction"),
    "lr_decay_steps": ("--train-iters", "--lr-decay-iters", "--train-samples", "--lr-decay-samples",
                       "--global-batch-size"),
    "lr_decay_style": ("--lr-decay-style",), "start_wd": ("--start-weight-decay",), "end_wd": ("--end-weight-decay",),
    "wd_incr_steps": ("--train-iters", "--train-samples", "--global-batch-size"),
    "wd_incr_style": ("--weight-decay-incr-style",),
}
# Also keys of the distributed optimizer's saved param groups: its state cannot load under new values.
OPTIMIZER_GROUP_VALUES = ("max_lr", "min_lr")


def iteration_dir(save: str, iteration: int) -> str:
    return os.path.join(save, f"iter_{iteration:07d}")   # Megatron's get_checkpoint_name(return_base_dir=True)


def schedule_settings(args: argparse.Namespace) -> dict:
    """SCHEDULE_VALUES of this run, derived from its flags as megatron.training does."""
    batch = args.global_batch_size
    if args.train_iters:
        decay = (args.lr_decay_iters or args.train_iters) * batch
        incr = args.train_iters * batch
        warmup = args.lr_warmup_fraction * decay if args.lr_warmup_fraction is not None else args.lr_warmup_iters * batch
    else:
        decay = args.lr_decay_samples or args.train_samples
        incr = args.train_samples
        warmup = args.lr_warmup_fraction * decay if args.lr_warmup_fraction is not None else args.lr_warmup_samples
    return {"max_lr": args.lr, "min_lr": args.min_lr, "lr_warmup_steps": warmup, "lr_decay_steps": decay,
            "lr_decay_style": args.lr_decay_style, "start_wd": args.start_weight_decay,
            "end_wd": args.end_weight_decay, "wd_incr_steps": incr, "wd_incr_style": args.weight_decay_incr_style}


def weights_are_finite(model_chunks) -> bool:
    """All ranks' weights finite (a collective over the world)."""
    import torch

    bad = any(not bool(torch.isfinite(p.detach()).all()) for chunk in model_chunks for p in chunk.parameters())
    device = next((p.device for chunk in model_chunks for p in chunk.parameters()), torch.device("cpu"))
    flag = torch.tensor([1.0 if bad else 0.0], device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return float(flag) == 0.0


def may_save(args: argparse.Namespace, iteration: int, model_chunks) -> bool:
    """Whether Megatron's save of `iteration` may go ahead (else one line says why not)."""
    if not getattr(args, "save", None):
        if getattr(args, "rank", 0) == 0:
            print(f"dcp: iteration {iteration}: a checkpoint was requested but there is no --save directory; "
                  "nothing saved", flush=True)
        return False
    if not weights_are_finite(model_chunks):
        if getattr(args, "rank", 0) == 0:
            print(f"dcp: error: iteration {iteration}: the weights hold NaN/Inf, so they are not saved; the latest "
                  f"checkpoint in {args.save} stays the last good one. Lower --lr or enable clipping (--clip-grad)",
                  flush=True)
        return False
    return True


def record_saved_checkpoint(args: argparse.Namespace, iteration: int) -> None:
    """After Megatron's save returned on every rank (a collective)."""
    manifest_io.record(iteration_dir(args.save, iteration), {"megatron": schedule_settings(args)})


def checkpoint_to_load(load: str, ckpt_step: int | None) -> str | None:
    """The iteration directory Megatron will load from `load`, None where there is none (fresh start)."""
    if ckpt_step:
        return iteration_dir(load, ckpt_step)
    tracker = os.path.join(load, TRACKER_FILE)
    if not os.path.isfile(tracker):
        return None
    with open(tracker) as f:
        text = f.read().strip()
    if text == "release":
        return os.path.join(load, "release")
    if not text.isdigit():   # Megatron refuses it itself, naming the file
        return None
    return iteration_dir(load, int(text))


def check_resume(args: argparse.Namespace) -> None:
    """Verify the checkpoint to resume and its schedule flags (see the module docstring)."""
    load = getattr(args, "load", None)
    directory = checkpoint_to_load(load, getattr(args, "ckpt_step", None)) if load and os.path.isdir(load) else None
    if directory is None:
        return
    if not os.path.isdir(directory):
        # Megatron would fail on it only after building the model (an assertion or FileNotFoundError).
        named_by = (f"--ckpt-step {args.ckpt_step}" if getattr(args, "ckpt_step", None)
                    else f"its tracker {os.path.join(load, TRACKER_FILE)}")
        raise DcpUsageError(f"--load {load}: {named_by} names {os.path.basename(directory)}, which does not exist; "
                            f"point the tracker at a saved iteration ({_saved_iterations(load)}) or fix --load")
    _check_format(args, directory)
    try:
        manifest = manifest_io.read_and_verify(directory, rank=getattr(args, "rank", 0),
                                               world_size=getattr(args, "world_size", 1))
    except manifest_io.CheckpointError as err:
        raise DcpUsageError(f"--load {load}: {err}") from err
    if manifest is None:
        if getattr(args, "dcp", False) and getattr(args, "rank", 0) == 0:
            # Megatron moves its tracker only after every rank wrote its files, so the checkpoint is whole; a
            # --dcp run stopped between that and the manifest (or a run without --dcp) leaves none.
            print(f"dcp: {directory} has no checksum manifest ({manifest_io.MANIFEST_FILE}): loaded unverified",
                  flush=True)
        return
    saved = manifest["settings"].get("megatron")
    # --finetune and --no-load-optim load neither the optimizer nor the scheduler: any flags apply.
    if saved and not getattr(args, "finetune", False) and not getattr(args, "no_load_optim", False):
        _check_schedule(args, saved, directory)
    if getattr(args, "rank", 0) == 0:
        print(f"dcp: {directory} verified against its checksum manifest ({len(manifest['files'])} files)", flush=True)


def _check_format(args: argparse.Namespace, directory: str) -> None:
    """A torch_dist checkpoint (its metadata.json names the backend) cannot load into a --ckpt-format torch run."""
    if getattr(args, "ckpt_format", None) != "torch":
        return
    try:
        with open(os.path.join(directory, "metadata.json")) as f:
            backend = json.load(f).get("sharded_backend")
    except (OSError, ValueError, AttributeError):
        return   # not a distributed checkpoint (torch format): Megatron loads it
    if backend:
        raise DcpUsageError(f"--load {args.load}: {os.path.basename(directory)} is a {backend} checkpoint and "
                            f"--ckpt-format is torch, which megatron-core 0.19.2 cannot load it into (it fails after "
                            f"building the model, also with --auto-detect-ckpt-format); resume with --ckpt-format "
                            f"{backend} (the default; it also reads torch-format checkpoints)")


def clear_interrupted_saves(save: str, *, rank: int) -> list[str]:
    """Rank 0, holding `save`'s lock: remove the empty `iter_*` directories a save killed before writing left
    behind (Megatron makes the directory first; they hold no checkpoint, but read as one to a `--load` check),
    never the tracker's iteration; say so, and name a newer non-empty one the tracker does not point at yet."""
    if rank != 0 or not os.path.isdir(save):
        return []
    tracked = _tracked_iteration(save)
    removed, newer = [], []
    for name in sorted(os.listdir(save)):
        directory = os.path.join(save, name)
        iteration = name[len("iter_"):]
        if not (name.startswith("iter_") and iteration.isdigit() and os.path.isdir(directory)) \
                or int(iteration) == tracked:
            continue
        if not any(files for _, _, files in os.walk(directory)):
            shutil.rmtree(directory)
            removed.append(name)
        elif tracked is not None and int(iteration) > tracked:
            newer.append(name)
    if removed:
        print(f"dcp: removed {', '.join(removed)} from --save {save}: empty directories of saves interrupted "
              f"before they wrote anything (the tracker names iteration {tracked})", flush=True)
    if newer:
        print(f"dcp: {', '.join(newer)} in --save {save} is newer than the tracker's iteration {tracked}: a save "
              "that did not finish; the run resumes from the tracker's iteration and overwrites it when it saves "
              "there", flush=True)
    return removed


def _tracked_iteration(save: str) -> int | None:
    try:
        with open(os.path.join(save, TRACKER_FILE)) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _saved_iterations(load: str) -> str:
    saved = sorted(name for name in os.listdir(load) if name.startswith("iter_"))
    return "saved: " + ", ".join(saved[-3:]) if saved else "none is saved there"


def _check_schedule(args: argparse.Namespace, saved: dict, directory: str) -> None:
    now = schedule_settings(args)
    changed = [name for name in SCHEDULE_VALUES if name in saved and saved[name] != now[name]]
    if not changed:
        return
    listed = "; ".join(f"{name} {now[name]} (checkpoint: {saved[name]}; from {'/'.join(SCHEDULE_VALUES[name])})"
                       for name in changed)
    optimizer_changed = [name for name in changed if name in OPTIMIZER_GROUP_VALUES]
    if optimizer_changed and getattr(args, "use_distributed_optimizer", False):
        raise DcpUsageError(
            f"--load {directory}: the learning rate changed since the checkpoint: {listed}. The distributed "
            f"optimizer's saved state is keyed by its learning rates, so it cannot load under new ones: keep the "
            f"checkpoint's values, or add --no-load-optim (the optimizer and scheduler state restart)")
    if getattr(args, "override_opt_param_scheduler", False):
        if getattr(args, "rank", 0) == 0:
            print(f"dcp: resuming with a changed schedule, following the flags (--override-opt_param-scheduler): "
                  f"{listed}", flush=True)
        return
    if getattr(args, "use_checkpoint_opt_param_scheduler", False):
        if getattr(args, "rank", 0) == 0:
            print(f"dcp: resuming with the checkpoint's schedule (--use-checkpoint-opt_param-scheduler), not the "
                  f"flags: {listed}", flush=True)
        return
    raise DcpUsageError(
        f"--load {directory}: the learning-rate schedule flags changed since the checkpoint: {listed}. Add "
        f"--override-opt_param-scheduler to follow the new flags, or --use-checkpoint-opt_param-scheduler to keep "
        f"the checkpoint's schedule (past its end the rate stays at its minimum), or restore the old values")
