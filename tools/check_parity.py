#!/usr/bin/env python
"""Gradient parity of the planned-step loop users run on random layouts, vs single-process training.

    .venv/bin/python tools/check_parity.py --world 4 --layouts 20 --seed 0
    torchrun --nproc-per-node 4 tools/check_parity.py --layouts 20 --seed 0   (world from torchrun)

Each layout is a random StepPlan on a domain of `world` ranks (random contiguous groups with
power-of-two groups aligned, random micro-batch split, random recompute, GQA, CP attention
variant alternating all-gather / ring) run on gloo through dcp_megatron/core/step_loop.py (document exchange,
micro-batch dicts, plan agreement) with the test harness's reference engine (tests/support/reference/),
compared with the full-batch single-process gradient of the same TinyGPT. Prints one line per layout; the LAST line is `max_rel_err=<value>`
(worst over layouts, parameters and ranks). Exit status 1 when it exceeds 1e-5 or a loss differs.
"""
from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dcp_megatron.planner.plan import StepPlan  # noqa: E402
from dcp_megatron.runtime.group_pool import GroupPool  # noqa: E402
from tests.support.reference.parity import parity_case  # noqa: E402
from local_ranks import run_local_ranks  # noqa: E402

TOLERANCE = 1e-5
LOSS_TOLERANCE = 1e-5


def run_layouts(layouts: int, seed: int, timeout_s: float) -> list[tuple[float, float, str]]:
    """On an initialised process group: (worst grad error over ranks, loss error, plan summary) per layout."""
    torch.set_num_threads(1)
    world = dist.get_world_size()
    pool = GroupPool([list(range(world))], timeout=timedelta(seconds=timeout_s))
    rows = []
    for i in range(layouts):
        case = parity_case(pool, seed * 100_003 + i, impl=("allgather", "ring")[i % 2])
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


def _spawned(rank: int, world: int, args):
    return run_layouts(args.layouts, args.seed, args.timeout)


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
    try:
        rows = run_local_ranks(_spawned, args.world, args, timeout_s=args.timeout)[0]
    except RuntimeError as err:
        print(err, file=sys.stderr)
        print("max_rel_err=nan")
        return 1
    return report(rows)


if __name__ == "__main__":
    sys.exit(main())
