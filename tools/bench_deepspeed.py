#!/usr/bin/env python3
"""DCP vs the static layout inside the DeepSpeed engine, on the same batches: measured and predicted ratios.

  .venv/bin/python tools/bench_deepspeed.py [--steps 12] [--zero-stage 1] [--json OUT]

Trains pretrain_scripts/pretrain_gpt_deepspeed.py on 2 CPU ranks (gloo) twice on the same global
batches (Megatron's mock dataset, --global-batch-size samples of --seq-length tokens per step) under the same
ZeRO stage and modelled memory per rank: once with `--dcp --dcp-policy static` (Megatron's layout:
the one CP size and recompute setting that fits the longest document, for every step) and once
with `--dcp`. Prints per-run mean step times over the steps after the first --warmup (start-up
costs), the measured ratio static / dcp and, beside it, the ratio the plans predicted for the same
steps, plus the loss traces (they must agree: same batches, same gradients). Numbers only: timing on a
shared 2-core VM varies from run to run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.support.deepspeed_runs import ds_config, run_deepspeed  # noqa: E402


def model_flags(args) -> list[str]:
    """Megatron's flags, as for pretrain_gpt.py (the CPU flags are defaulted by the script)."""
    return ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--group-query-attention",
            "--num-query-groups", "2", "--ffn-hidden-size", "384", "--swiglu", "--disable-bias-linear",
            "--normalization", "RMSNorm", "--untie-embeddings-and-output-weights", "--seq-length",
            str(args.seq_length), "--max-position-embeddings", str(args.seq_length), "--micro-batch-size", "1",
            "--global-batch-size", str(args.global_batch_size), "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "256", "--dataloader-inter-document-masking", "--attention-dropout", "0",
            "--hidden-dropout", "0", "--distributed-timeout-minutes", "5", "--seed", "1234", "--log-interval", "1"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--zero-stage", type=int, default=1, choices=(0, 1, 2, 3))
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--global-batch-size", type=int, default=4, help="samples of --seq-length tokens per step")
    parser.add_argument("--memory-budget-gb", type=float, default=0.033)   # real bytes, as tools/demo.py
    parser.add_argument("--json", default=None, help="write the numbers to this file")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    budget = ["--dcp-memory-budget-gb", str(args.memory_budget_gb)]
    config = ds_config(stage=args.zero_stage, total_steps=args.steps)
    results = {}
    for name, extra in (("static", ["--dcp", "--dcp-policy", "static", *budget]), ("dcp", ["--dcp", *budget])):
        run = run_deepspeed(config, extra, iters=args.steps, model=model_flags(args))
        run.check()
        steps = [run.dcp_steps[i] for i in sorted(run.dcp_steps) if i > args.warmup]
        results[name] = {
            "measured_ms": statistics.mean(s["measured_ms"] for s in steps),
            "predicted_ms": statistics.mean(s["predicted_ms"] for s in steps),
            "losses": run.loss_trace(), "plans": sorted({s["cp_sizes"] for s in steps})[:4],
            "counts": [s["counts"] for s in steps][:4],
        }
        print(f"{name:6s}: mean step {results[name]['measured_ms']:.1f} ms measured, "
              f"{results[name]['predicted_ms']:.1f} ms predicted (steps {args.warmup + 1}-{args.steps}); "
              f"e.g. cp sizes {results[name]['plans'][:2]}, micro-batches/rank {results[name]['counts'][:2]}")
    measured = results["static"]["measured_ms"] / results["dcp"]["measured_ms"]
    predicted = results["static"]["predicted_ms"] / results["dcp"]["predicted_ms"]
    worst = max(abs(a - b) / abs(b) for a, b in zip(results["dcp"]["losses"], results["static"]["losses"]))
    print(f"DeepSpeed ZeRO-{args.zero_stage}, 2 CPU ranks: dcp vs static {measured:.2f}x measured, "
          f"{predicted:.2f}x predicted; loss traces max rel difference {worst:.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"zero_stage": args.zero_stage, "measured_ratio": measured, "predicted_ratio": predicted,
                       "loss_max_rel_diff": worst, "runs": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
