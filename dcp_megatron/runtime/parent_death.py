"""A helper process that ends with the process that started it (Linux `prctl(PR_SET_PDEATHSIG)`).

A rank ended by a signal runs no exit handler, so a `multiprocessing` helper it started (a manager's server
process) would live on, orphaned. `die_with_parent(parent_pid)` is the helper's initializer: the kernel sends it
SIGKILL when its parent ends. Pure os/ctypes (the helper imports this module, nothing heavy).
"""
from __future__ import annotations

import os
import signal

_PR_SET_PDEATHSIG = 1   # linux/prctl.h


def die_with_parent(parent_pid: int) -> None:
    """In the helper process: SIGKILL when `parent_pid` (its parent) ends; elsewhere than Linux, nothing."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:   # it ended before the request
        os._exit(0)
