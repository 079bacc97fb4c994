"""Patch for `deepspeed.comm.torch`: the process groups DeepSpeed creates keep the job's collective timeout.

DeepSpeed 0.19.8's `TorchBackend.new_group(ranks)` calls `torch.distributed.new_group(ranks)` without a
timeout, so every group DeepSpeed creates gets torch's default (30 min on gloo, 10 min on NCCL) instead of
the timeout `deepspeed.init_distributed(timeout=...)` was given (our `--distributed-timeout-minutes`).
Among them is its copy of the world group, on which ZeRO reduces the gradients of every step: with one
rank SIGSTOPped, a survivor waiting there hung for 30 min while one waiting in a DCP group (which has the
timeout) stopped in seconds, naming the rank (reproduced: 1 run in 2-3 of the fault matrix's DeepSpeed
SIGSTOP case). The replacement passes the job's timeout; nothing else about the group changes.
"""
from __future__ import annotations

from datetime import timedelta

from patches import DEEPSPEED_VERSIONS
from patches.registry import Patch

_TARGET = "deepspeed.comm.torch:TorchBackend.new_group"


def _new_group_with_timeout(timeout: timedelta):
    def new_group(self, ranks):
        import torch.distributed

        return torch.distributed.new_group(ranks, timeout=timeout)

    return new_group


def dcp_patches(*, timeout: timedelta) -> tuple[Patch, ...]:
    if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(f"the collective timeout must be a positive timedelta, got {timeout!r}")
    return (
        Patch(
            target=_TARGET,
            replacement=_new_group_with_timeout(timeout),
            reason="DeepSpeed's groups (ZeRO's gradient reduction among them) get torch's default 30 min "
                   "timeout, not the job's --distributed-timeout-minutes; a stopped rank hung the others.",
            versions=DEEPSPEED_VERSIONS,
            distribution="deepspeed",
        ),
    )


# --- The shared-memory collectives op (CPU) -------------------------------------------------------------------
# DeepSpeed 0.19.8's `TorchBackend.__init__` calls `build_shm_op()`, which on the CPU accelerator JIT-compiles
# the `deepspeed_shm_comm` C++ op in every process at first use (~1-2 min). torch's build lock (FileBaton) waits
# forever when a process was killed while compiling, so every later DeepSpeed run on that machine hung silently
# (seen here); a half-built cache gives an ImportError instead. The op only speeds up DeepSpeed's own CPU
# all-reduce; with `shm_comm_op = None` DeepSpeed uses torch.distributed (gloo), which is what our runs use.

_SHM_TARGET = "deepspeed.comm.torch:build_shm_op"


def _no_shm_op():
    return None


def shm_comm_patches() -> tuple[Patch, ...]:
    """Apply before `deepspeed.init_distributed` (that is where the op is built)."""
    return (
        Patch(
            target=_SHM_TARGET,
            replacement=_no_shm_op,
            reason="DeepSpeed JIT-compiles its deepspeed_shm_comm op in every process at init; a stale torch build "
                   "lock left by a killed process hangs every later run silently. Training does not need the op.",
            versions=DEEPSPEED_VERSIONS,
            distribution="deepspeed",
        ),
    )
