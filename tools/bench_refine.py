#!/usr/bin/env python3
"""Online refinement against a deliberately wrong profile: does the cost model correct itself?

  .venv/bin/python tools/bench_refine.py [--iters 12] [--attention-speedup 2]

Writes a profile whose attention rates are `--attention-speedup` times the `cpu` preset's (attention
modelled 2x too fast by default), then trains our script through megatron.training on 2 CPU ranks
with `--dcp` twice on the same batches: with `--dcp-no-refine` (the wrong profile all along) and with
refinement (the default). Prints, per step, the step-time error |predicted - measured| / measured of
both runs and, for the steps after the first three (refinement needs a step to measure and, planning
one step ahead, a step to apply it), the mean error and the mean measured forward-backward time.
Numbers only: timing on a shared 2-core VM varies from run to run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dcp_megatron.planner.costmodel.cluster_cpu import CPU_ATTN_RATE_POINTS  # noqa: E402
from tests.support.megatron_runs import OUR_SCRIPT, run_training  # noqa: E402

SETTLED_FROM = 4


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--attention-speedup", type=float, default=2.0)
    parser.add_argument("--budget-gb", type=float, default=0.004)
    args = parser.parse_args(argv)
    if args.iters < SETTLED_FROM + 1:
        parser.error(f"--iters must be at least {SETTLED_FROM + 1}")
    with tempfile.TemporaryDirectory() as tmp:
        profile = os.path.join(tmp, "wrong_profile.json")
        with open(profile, "w") as f:
            json.dump({"attn_rate_points": [[length, rate * args.attention_speedup]
                                            for length, rate in CPU_ATTN_RATE_POINTS]}, f)
        common = ["--dcp", "--dcp-memory-budget-gb", str(args.budget_gb), "--dcp-profile", profile,
                  "--dcp-check-plans"]
        steps = {}
        for label, extra in (("fixed", ["--dcp-no-refine"]), ("refined", [])):
            run = run_training(OUR_SCRIPT, common + extra, iters=args.iters).check()
            steps[label] = {i: (step["predicted_ms"], step["measured_ms"]) for i, step in run.dcp_steps.items()}
    print(f"profile: attention {args.attention_speedup}x faster than the cpu preset; 2 ranks, {args.iters} steps")
    print("step   fixed: predicted / measured (error)      refined: predicted / measured (error)")
    for step in sorted(steps["fixed"]):
        cells = []
        for label in ("fixed", "refined"):
            predicted, measured = steps[label][step]
            cells.append(f"{predicted:8.1f} / {measured:8.1f} ms ({abs(predicted - measured) / measured:4.0%})")
        print(f"{step:4d}   {cells[0]}     {cells[1]}")
    for label in ("fixed", "refined"):
        late = [v for k, v in steps[label].items() if k >= SETTLED_FROM]
        error = statistics.mean(abs(p - m) / m for p, m in late)
        print(f"{label:8s} steps {SETTLED_FROM}-{args.iters}: mean step-time error {error:.0%}, mean measured "
              f"forward-backward {statistics.mean(m for _, m in late):.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
