"""Start-up checks of a run's output and resume paths, before any model is built.

Megatron first touches `--save` when it saves (after training up to `--save-interval`: a `--save` that is
a file, or a directory it cannot write, loses the run then), and a `--load` that does not exist or holds
no checkpoint only draws a warning before training starts from scratch. Through our patches
(patches/training_arguments.py, with or without `--dcp`) these stop the run at start-up instead:

- `--save`, `--tensorboard-dir`, `--dcp-dump-plans`: must be a directory or creatable, and writable;
- `--load DIR` other than `--save` (the user asks to resume from it): DIR must hold a Megatron
  checkpoint (its tracker file or an `iter_*` directory). `--load` equal to `--save` is Megatron's
  auto-resume pattern: its first run has nothing to load yet, so it is left to Megatron;
- the checkpoint either resolves to is verified against its checksum manifest and its schedule flags
  (dcp_megatron.megatron.checkpoints.py);
- `--save`: this run holds it (a lock naming the run), so a second run on it is refused
  (dcp_megatron/runtime/save_lock.py); then the empty `iter_*` directories of interrupted saves are
  removed from it (checkpoints.clear_interrupted_saves).
"""
from __future__ import annotations

import argparse
import glob
import os
import tempfile

from dcp_megatron.megatron.dcp_args import DcpUsageError

# Megatron's checkpoint tracker file (megatron.training.checkpointing.get_checkpoint_tracker_filename).
TRACKER_FILE = "latest_checkpointed_iteration.txt"


def check_writable_dir(path: str, flag: str) -> None:
    """`path` is a writable directory or can be created as one."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise DcpUsageError(f"{flag} {path}: exists and is not a directory; give a directory")
    parent = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise DcpUsageError(f"{flag} {path}: {parent} is a file, so the directory cannot be created")
    # os.access trusts the permission bits (root passes them everywhere, also on /sys): create and remove a file.
    try:
        fd, probe = tempfile.mkstemp(prefix=".dcp-write-check-", dir=parent)
        os.close(fd)
        os.remove(probe)
    except OSError as err:
        raise DcpUsageError(f"{flag} {path}: {parent} is not writable ({err.strerror or err}); give a directory "
                            "this run can write") from None


def holds_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, TRACKER_FILE)) or bool(glob.glob(os.path.join(path, "iter_*")))


def check_run_paths(args: argparse.Namespace) -> None:
    """All start-up path checks of a megatron.training run (see the module docstring)."""
    for flag, attr in (("--save", "save"), ("--tensorboard-dir", "tensorboard_dir"),
                       ("--dcp-dump-plans", "dcp_dump_plans")):
        path = getattr(args, attr, None)
        if path:
            check_writable_dir(path, flag)
    load, save = getattr(args, "load", None), getattr(args, "save", None)
    if load and not (save and os.path.abspath(load) == os.path.abspath(save)):
        check_resume_dir(load, holds=holds_checkpoint, expected=f"Megatron checkpoint (no {TRACKER_FILE} and no iter_* "
                                                                   "directory)")
    from dcp_megatron.megatron.checkpoints import check_resume  # it reads TRACKER_FILE from here

    check_resume(args)   # the checkpoint it resolves to: checksums and schedule flags
    if save:
        hold_save_dir_or_refuse(save)   # last: a refusal above must not leave a lock behind
        from dcp_megatron.megatron.checkpoints import clear_interrupted_saves

        clear_interrupted_saves(save, rank=getattr(args, "rank", 0))   # holding the lock: no save is running


def hold_save_dir_or_refuse(save: str, flag: str = "--save") -> None:
    """This run holds `save` for its checkpoints (rank 0 takes the lock; runtime/save_lock.py)."""
    from dcp_megatron.runtime.save_lock import SaveDirInUse, hold_save_dir

    try:
        hold_save_dir(save, flag=flag)
    except SaveDirInUse as err:
        raise DcpUsageError(str(err)) from None


def check_resume_dir(load: str, *, holds, expected: str) -> None:
    """`--load DIR` the user asks to resume from: DIR exists and `holds(DIR)` (else say which is wrong)."""
    if not os.path.isdir(load):
        raise DcpUsageError(f"--load {load}: no such directory, so there is nothing to resume from; fix the path, "
                            f"or drop --load to train from scratch")
    if not holds(load):
        raise DcpUsageError(f"--load {load}: holds no {expected}; fix the path, or drop --load to train from scratch")
