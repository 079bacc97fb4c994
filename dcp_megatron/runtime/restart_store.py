"""The default process group of a worker torchrun restarted (`--max-restarts`), on a store of its own attempt.

torchrun's agent keeps one rendezvous store for all attempts of a job, and torch (2.13) has every worker's
`init_process_group` (env://) use it without a per-attempt prefix: a restarted gloo worker reads the address its
dead peer of the previous attempt left there and fails to connect (`Gloo connectFullMesh failed ... Connection
refused`; NCCL's unique id has the same key). `init_after_restart` initializes the default group itself on the
agent's store under a prefix naming the attempt (TORCHELASTIC_RESTART_COUNT), before the engine's own
initialization, which then finds it initialized and skips it. On the first attempt and outside torchrun it does
nothing. (torch only.)
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch


def restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def init_after_restart(*, backend: str, timeout: timedelta) -> bool:
    """Initialize the default process group on this attempt's own store when torchrun restarted this worker;
    True when it did."""
    import torch.distributed as dist

    if (restart_count() == 0 or dist.is_initialized()
            or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"):
        return False
    if torch.cuda.is_available():   # as the engines do before their own initialization
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout)
    dist.init_process_group(backend=backend, store=dist.PrefixStore(f"dcp_attempt_{restart_count()}", agent),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=timeout)
    return True
