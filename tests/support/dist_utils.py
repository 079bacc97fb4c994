"""Run a function on N local gloo ranks from a pytest test, with tracebacks and no hangs.

    results = run_distributed(worker_fn, 4, arg1, arg2, timeout_s=300)

`worker_fn(rank, world_size, *args)` must be a module-level (picklable) function; it runs in a
fresh spawned process with the default process group initialised (gloo, a file store in a fresh
temporary directory: no port to pick, so runs beside other jobs never collide) and one intra-op thread. Its return value (picklable) comes back in rank order. If any
rank raises, the others are given a short grace period and then terminated, and a RuntimeError
carrying every failing rank's traceback is raised; past timeout_s, a TimeoutError names the
ranks that never finished. Workers end with barrier(); destroy_process_group().

Launching costs ~10-20 s of imports on this machine: run many cases inside one launch.
"""
from __future__ import annotations

import os
import queue
import shutil
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# After the first failure, how long the other ranks get to report theirs before being killed.
_FAILURE_GRACE_S = 15.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def resident_bytes(pid: int) -> int:
    """A live process's resident set (VmRSS), 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
    except (FileNotFoundError, ProcessLookupError):
        return 0


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0,
                    backend: str = "gloo", group_timeout_s: float = 60.0,
                    max_rss_bytes: float | None = None) -> list[Any]:
    """fn(rank, world_size, *args) on world_size spawned ranks; returns their results in rank order.
    `max_rss_bytes`: a rank whose resident set grows past it (read every half second) is killed and reported as
    failed, so a run whose memory runs away fails the test long before the machine runs out."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    reports = ctx.Queue()
    store_dir = tempfile.mkdtemp(prefix="dcp-ranks-")
    init_method = "file://" + os.path.join(store_dir, "store")
    procs = [ctx.Process(target=_worker, args=(fn, rank, world_size, init_method, backend, group_timeout_s, args,
                                               reports), daemon=True)
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    give_up_at = deadline
    try:
        while len(results) + len(errors) < world_size and time.monotonic() < give_up_at:
            try:
                rank, ok, payload = reports.get(timeout=0.5)
            except queue.Empty:
                for rank, proc in enumerate(procs):
                    if proc.exitcode not in (None, 0) and rank not in results and rank not in errors:
                        errors[rank] = f"rank {rank} exited with code {proc.exitcode} without reporting"
            else:
                (results if ok else errors)[rank] = payload
            for rank, proc in enumerate(procs if max_rss_bytes else ()):
                rss = resident_bytes(proc.pid) if proc.is_alive() else 0
                if rss > max_rss_bytes:
                    proc.kill()
                    errors[rank] = (f"rank {rank} killed: resident set {rss / 2**30:.2f} GiB past the test's "
                                    f"bound of {max_rss_bytes / 2**30:.2f} GiB")
            if errors:
                give_up_at = min(give_up_at, time.monotonic() + _FAILURE_GRACE_S)
    finally:
        for proc in procs:
            proc.join(timeout=1.0 if not errors and len(results) == world_size else 0.1)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5.0)
        shutil.rmtree(store_dir, ignore_errors=True)
    if errors:
        details = "\n".join(f"--- rank {rank} ---\n{text}" for rank, text in sorted(errors.items()))
        raise RuntimeError(f"{len(errors)} of {world_size} ranks failed:\n{details}")
    if len(results) < world_size:
        missing = sorted(set(range(world_size)) - set(results))
        raise TimeoutError(f"ranks {missing} did not finish within {timeout_s:.0f} s")
    return [results[rank] for rank in range(world_size)]


def _worker(fn, rank, world_size, init_method, backend, group_timeout_s, args, reports) -> None:
    torch.set_num_threads(1)  # ranks share a couple of cores; oversubscription only slows everyone
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=group_timeout_s))
        result = fn(rank, world_size, *args)
        dist.barrier()
        dist.destroy_process_group()
        reports.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent with its traceback
        reports.put((rank, False, traceback.format_exc()))
        raise SystemExit(1)


def group_timeout_s(group) -> float:
    """The collective timeout of a gloo process group (seconds)."""
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def group_timeouts_s() -> dict[str, float]:
    """The collective timeout of every process group this process has created, by group name (the default
    group included): a group created without one has torch's default (30 min on gloo)."""
    from torch.distributed import distributed_c10d

    return {group.group_name: group_timeout_s(group) for group in distributed_c10d._world.pg_map}


def max_rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (0 when both are all zero)."""
    scale = expected.abs().max().item() if expected.numel() else 0.0
    diff = (actual - expected).abs().max().item() if expected.numel() else 0.0
    return diff / scale if scale > 0 else diff
