"""Start-up checks of a megatron.training run's output and resume paths, before any model is built.

Megatron first touches `--save` when it saves (after training up to `--save-interval`: a `--save` that is
a file, or a directory it cannot write, loses the run then), and a `--load` that does not exist or holds
no checkpoint only draws a warning before training starts from scratch. Through our patches
(patches/training_arguments.py, with or without `--dcp`) these stop the run at start-up instead:

- `--save`, `--tensorboard-dir`, `--dcp-dump-plans`: must be a directory or creatable, and writable;
- `--load DIR` other than `--save` (the user asks to resume from it): DIR must hold a Megatron
  checkpoint (its tracker file or an `iter_*` directory). `--load` equal to `--save` is Megatron's
  auto-resume pattern: its first run has nothing to load yet, so it is left to Megatron;
- the checkpoint either resolves to is verified against its checksum manifest and its schedule flags
  (dcp_megatron/training/checkpoints.py);
- `--save`: this run holds it (a lock naming the run), so a second run on it is refused; then the empty
  `iter_*` directories of interrupted saves are removed from it (checkpoints.clear_interrupted_saves).
"""
from __future__ import annotations

import argparse
import glob
import os

from dcp_megatron.flags.run_paths import check_resume_dir, check_writable_dir, hold_save_dir_or_refuse
from dcp_megatron.training.checkpoints import TRACKER_FILE, check_resume, clear_interrupted_saves


def holds_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, TRACKER_FILE)) or bool(glob.glob(os.path.join(path, "iter_*")))


def check_run_paths(args: argparse.Namespace) -> None:
    """All start-up path checks of a megatron.training run (see the module docstring)."""
    for flag, attr in (("--save", "save"), ("--tensorboard-dir", "tensorboard_dir"),
                       ("--dcp-dump-plans", "dcp_dump_plans"), ("--dcp-dump-saved-bytes", "dcp_dump_saved_bytes")):
        path = getattr(args, attr, None)
        if path:
            check_writable_dir(path, flag)
    load, save = getattr(args, "load", None), getattr(args, "save", None)
    if load and not (save and os.path.abspath(load) == os.path.abspath(save)):
        check_resume_dir(load, holds=holds_checkpoint, expected=f"Megatron checkpoint (no {TRACKER_FILE} and no iter_* "
                                                                   "directory)")
    check_resume(args)   # the checkpoint it resolves to: checksums and schedule flags
    if save:
        hold_save_dir_or_refuse(save)   # last: a refusal above must not leave a lock behind
        clear_interrupted_saves(save, rank=getattr(args, "rank", 0))   # holding the lock: no save is running
