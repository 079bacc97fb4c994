"""Run a function on N local gloo ranks and collect what each returns: the one spawn helper of tools/.

    from local_ranks import run_local_ranks
    results = run_local_ranks(measure, 2, args)   # measure(rank, world_size, args) on each rank, in rank order

Each rank is a spawned process with one intra-op thread and a gloo process group over a free local port. A rank
that raises or exits ends the call with a RuntimeError naming it (with its traceback); none is left waiting.
"""
from __future__ import annotations

import queue
import socket
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child(rank: int, world_size: int, port: int, timeout_s: float, target, args, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    try:
        results.put((rank, True, target(rank, world_size, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        raise
    dist.barrier()
    dist.destroy_process_group()


def run_local_ranks(target, world_size: int, *args, timeout_s: float = 1800.0) -> list:
    """`target(rank, world_size, *args)` on `world_size` local ranks; their return values in rank order."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world_size, port, timeout_s, target, args, results))
             for r in range(world_size)]
    for proc in procs:
        proc.start()
    values, failures = {}, {}
    try:
        while len(values) + len(failures) < world_size:
            try:
                rank, ok, value = results.get(timeout=1.0)
                (values if ok else failures)[rank] = value
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in values]
                if dead:
                    failures.update({r: f"exited with code {procs[r].exitcode}" for r in dead if r not in failures})
            if failures:
                break
    finally:
        for proc in procs:
            proc.join(timeout=30 if not failures else 1)
            if proc.is_alive():
                proc.terminate()
    if failures:
        raise RuntimeError("ranks failed:\n" + "\n".join(f"--- rank {r} ---\n{text}" for r, text in sorted(failures.items())))
    return [values[r] for r in range(world_size)]
