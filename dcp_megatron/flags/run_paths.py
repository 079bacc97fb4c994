"""Start-up checks of output and resume paths both engines run, before any model is built.

- an output directory (`--save`, `--tensorboard-dir`, `--dcp-dump-plans`, DeepSpeed's save path) must be a
  directory or creatable, and writable (a file is created and removed: permission bits lie to root);
- a resume directory must exist and hold the engine's checkpoint (`check_resume_dir(holds=...)`);
- a save directory is held by this run (a lock naming the run, dcp_megatron/runtime/save_lock.py), so a second
  run on it is refused.
The megatron.training run's own sequence of these checks is dcp_megatron/training/checks/run_paths.py.
"""
from __future__ import annotations

import os
import tempfile

from dcp_megatron.config import DcpUsageError

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
