#!/usr/bin/env python
"""Gradient parity of the DCP executor on random layouts, vs single-process training.

    .venv/bin/python tools/check_parity.py --world 4 --layouts 20 --seed 0
    torchrun --nproc-per-node 4 tools/check_parity.py --layouts 20 --seed 0   (world from torchrun)

Each layout is a random StepPlan on a domain of `world` ranks (random contiguous groups with
power-of-two groups aligned, random micro-batch split, random recompute, GQA, CP attention
variant alternating all-gather / ring) run on gloo, compared with the full-batch single-process
gradient of the same TinyGPT. Prints one line per layout; the LAST line is `max_rel_err=<value>`
(worst over layouts, parameters and ranks). Exit status 1 when it exceeds 1e-5 or a loss differs.
"""
from __future__ import annotations

import argparse
import os
import queue
import socket
import sys
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from dcp_megatron.planner.plan import StepPlan  # noqa: E402
from dcp_megatron.runtime.executor import StepExecutor  # noqa: E402
from dcp_megatron.runtime.group_pool import GroupPool  # noqa: E402
from dcp_megatron.runtime.parity import parity_case  # noqa: E402

TOLERANCE = 1e-5
LOSS_TOLERANCE = 1e-5


def run_layouts(layouts: int, seed: int, timeout_s: float) -> list[tuple[float, float, str]]:
    """On an initialised process group: (worst grad error over ranks, loss error, plan summary) per layout."""
    torch.set_num_threads(1)
    world = dist.get_world_size()
    pool = GroupPool([list(range(world))], timeout=timedelta(seconds=timeout_s))
    executor = StepExecutor(pool)
    rows = []
    for i in range(layouts):
        case = parity_case(executor, seed * 100_003 + i, impl=("allgather", "ring")[i % 2])
        worst = torch.tensor([case["max_rel_err"], abs(case["loss"] - case["ref_loss"])], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        rows.append((float(worst[0]), float(worst[1]), StepPlan.from_json(case["plan"]).summary()))
    return rows


def report(rows: list[tuple[float, float, str]]) -> int:
    for i, (err, loss_err, summary) in enumerate(rows):
        print(f"layout {i:3d}: grad_rel_err={err:.3e} loss_abs_err={loss_err:.3e}  {summary}")
    worst = max((err for err, _, _ in rows), default=0.0)
    worst_loss = max((loss_err for _, loss_err, _ in rows), default=0.0)
    print(f"max_rel_err={worst:.6e}")
    return 0 if worst <= TOLERANCE and worst_loss <= LOSS_TOLERANCE else 1


def _spawned(rank: int, world: int, port: int, args, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=args.timeout))
    rows = run_layouts(args.layouts, args.seed, args.timeout)
    if rank == 0:
        results.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4, help="local ranks to spawn (ignored under torchrun)")
    parser.add_argument("--layouts", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=120.0, help="group timeout, seconds")
    args = parser.parse_args(argv)
    if args.world < 1 or args.layouts < 1:
        parser.error(f"--world and --layouts must be >= 1, got {args.world} and {args.layouts}")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
        rows = run_layouts(args.layouts, args.seed, args.timeout)
        code = report(rows) if dist.get_rank() == 0 else 0
        dist.barrier()
        dist.destroy_process_group()
        return code
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_spawned, args=(r, args.world, port, args, results)) for r in range(args.world)]
    for proc in procs:
        proc.start()
    rows = None
    try:
        while rows is None and not any(proc.exitcode not in (None, 0) for proc in procs):
            try:
                rows = results.get(timeout=1.0)
            except queue.Empty:
                continue
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()
    failed = [r for r, proc in enumerate(procs) if proc.exitcode != 0]
    if failed or rows is None:
        print(f"ranks {failed} failed", file=sys.stderr)
        print("max_rel_err=nan")
        return 1
    return report(rows)


if __name__ == "__main__":
    sys.exit(main())
