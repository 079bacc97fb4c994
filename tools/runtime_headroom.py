#!/usr/bin/env python
"""How much any plan can gain over static CP=2 on bench_runtime's 2-rank domain, by the cost model.

    .venv/bin/python tools/runtime_headroom.py [--mem-per-rank-mib 24,40,128] [--max-seq-len 4096,1000000]
                                               [--tokens-per-step 8192,32768] [--steps 24] [--json OUT]

For every regime in the grid (modelled memory per rank, upper bound of the length cap, tokens per
step) it makes bench_runtime's long-tailed batches, plans them with `static` and `dcp`, and prints
the predicted ratio (static / dcp estimates) and the ceiling (static / the memory-aware lower
bound, which no plan can beat), over summed seconds (= tokens/s, the benchmark's quantity) and as
the median over batches. Seconds only: nothing is trained. Regimes whose static layout is not CP=2
(the cap fits on one rank, so static is plain data parallelism) are shown but left out of the
maximum, since the benchmark compares against static CP=2. The last line is the largest summed
ceiling among the CP=2 regimes: the most tokens/s any plan can gain there.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # tools/: bench_runtime adds the repo root

import bench_runtime  # noqa: E402
from dcp_megatron.planner.baselines.static import static_layout  # noqa: E402


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _float_list(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def regime_row(mem_mib: float, max_seq_len: int, tokens_per_step: int, steps: int, seed: int) -> dict:
    cost = bench_runtime.cost_model(mem_mib)
    cap = bench_runtime.memory_cap(cost, min(max_seq_len, tokens_per_step))
    layout = static_layout(cost, cap)
    args = argparse.Namespace(steps=steps, tokens_per_step=tokens_per_step, max_seq_len=max_seq_len, seed=seed)
    batches = {"longtail": bench_runtime.make_batches(args, cap)["longtail"]}
    ratios = bench_runtime.predicted_ratios(bench_runtime.make_plans(batches, cost, cap))
    return {"mem_per_rank_mib": mem_mib, "max_seq_len": max_seq_len, "tokens_per_step": tokens_per_step,
            "cap": cap, "static_cp_size": layout.cp_size, "static_recompute": str(layout.recompute),
            **{key.replace("ratio_longtail_", ""): value for key, value in ratios.items()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mem-per-rank-mib", type=_float_list, default=[24, 32, 40, 48, 64, 96, 128, 192, 256])
    parser.add_argument("--max-seq-len", type=_int_list, default=[2048, 4096, 8192, 16384, 1000000])
    parser.add_argument("--tokens-per-step", type=_int_list, default=[8192, 16384, 32768, 65536])
    parser.add_argument("--steps", type=int, default=24, help="timed batches per regime (plus bench_runtime's warm-up)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the table here")
    args = parser.parse_args(argv)
    grid = (args.mem_per_rank_mib, args.max_seq_len, args.tokens_per_step)
    if args.steps < 1 or not all(grid) or min(map(min, grid)) <= 0 or min(args.max_seq_len) < 2:
        parser.error("--steps >= 1; every list non-empty and positive; --max-seq-len values >= 2")
    rows = []
    print(f"{'MiB':>5} {'max_len':>8} {'tok/step':>8} {'cap':>6} {'static':>12} | summed: predicted ceiling | "
          f"median: predicted ceiling")
    for mem, max_len, tokens in itertools.product(*grid):
        try:
            row = regime_row(mem, max_len, tokens, args.steps, args.seed)
        except ValueError as err:   # a budget that holds nothing: say so and go on with the grid
            print(f"{mem:5g} {max_len:8d} {tokens:8d}  no plan: {err}", flush=True)
            continue
        rows.append(row)
        print(f"{mem:5g} {max_len:8d} {tokens:8d} {row['cap']:6d} {'CP%d/%s' % (row['static_cp_size'], row['static_recompute']):>12} |"
              f" {row['predicted']:17.3f} {row['ceiling']:7.3f} | {row['predicted_median']:17.3f} {row['ceiling_median']:7.3f}",
              flush=True)
    cp2 = [r for r in rows if r["static_cp_size"] == 2]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if not cp2:
        print("no regime in the grid has a static CP=2 layout")
        return 0
    best = max(cp2, key=lambda r: r["ceiling"])
    print(f"{len(cp2)} of {len(rows)} regimes run static at CP=2; largest summed ceiling "
          f"{best['ceiling']:.3f} (predicted {best['predicted']:.3f}) at {best['mem_per_rank_mib']:g} MiB, "
          f"cap {best['cap']}, {best['tokens_per_step']} tokens/step")
    print(f"max_ceiling={best['ceiling']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
