#!/usr/bin/env python3
"""The CPU demo: DCP vs Megatron's static context parallelism on real text, 2 ranks, ~30 steps.

  .venv/bin/python tools/demo.py            (what `make demo` runs)

1. Builds a small real-text dataset from the Python standard library's own sources (the
   tools/make_demo_data.py code path: one document per top-level definition, byte tokenizer),
   whose document lengths are long-tailed like a pretraining corpus.
2. Trains a small GPT (gpt-tiny: 4 layers, hidden 128, GQA 4/2 heads) with
   pretrain_scripts/pretrain_gpt.py on 2 CPU ranks (gloo) twice on identical global batches:
   with --dcp (each step's lengths decide CP sizes, micro-batches and recompute), and with
   the static baseline --context-parallel-size 2 (every sequence split over both ranks).
3. Prints both runs' tokens/s and the ratio. Iteration lines stream while the runs go.

Documents longer than --seq-length are split (--overlong split), so long definitions stay in.
"""
from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LINE = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*?elapsed time per iteration \(ms\): ([\d.]+) \|"
                  r" predicted \(ms\): ([\d.]+) \|.*?tokens/s: ([\d.]+) \|.*?lm loss: (\S+) \|.*?imbalance: ([\d.]+).*?\| plan \S+ waves (\d+) \|"
                  r" cp sizes (\S+) \| micro-batches/rank (\S+) \| recompute (\S+) \|")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def build_dataset(prefix: str, max_files: int) -> None:
    import make_demo_data  # tools/ is on sys.path when run as a script

    if make_demo_data.main(["--output-prefix", prefix, "--max-files", str(max_files)]) != 0:
        raise SystemExit("demo: building the dataset failed")


def train(label: str, prefix: str, args: argparse.Namespace, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(_free_port()), os.path.join(ROOT, "pretrain_scripts", "pretrain_gpt.py"),
           "--data-path", prefix, "--vocab-size", "257", "--overlong", "split",
           "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--num-query-groups", "2",
           "--ffn-hidden-size", "384", "--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm",
           "--seq-length", str(args.seq_length), "--tokens-per-step", str(args.tokens_per_step),
           "--train-iters", str(args.steps), "--lr", "3e-3", "--lr-warmup-iters", "3", "--min-lr", "3e-4",
           "--seed", "1234", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=ROOT)
    print(f"\n== {label}: {' '.join(extra)}", flush=True)
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    steps, tail = [], []
    for line in proc.stdout:
        tail = (tail + [line])[-40:]
        match = LINE.search(line)
        if match:
            it, total, ms, predicted_ms, tps, loss, imb, waves, hist, mbs, rc = match.groups()
            steps.append((float(ms), float(tps), float(predicted_ms)))
            print(f"  [{label}] step {int(it):3d}/{int(total)}  loss {float(loss):.4f}  {float(ms):7.1f} ms"
                  f"  {float(tps):8.0f} tok/s  imbalance {float(imb):.2f}  waves {waves}  {hist}  mb/rank {mbs}"
                  f"  recompute {rc}", flush=True)
    if proc.wait() != 0:
        sys.stdout.write("".join(tail))
        raise SystemExit(f"demo: the {label} run failed (exit {proc.returncode})")
    # The first steps include warm-up (allocator, group creation): leave them out of the rate.
    measured = steps[args.warmup_steps:] or steps
    total_ms = sum(ms for ms, _, _ in measured)
    tokens = sum(ms * tps / 1000 for ms, tps, _ in measured)
    predicted_ms = sum(p for _, _, p in measured)
    return {"tokens_per_s": tokens / (total_ms / 1000), "predicted_tokens_per_s": tokens / (predicted_ms / 1000),
            "wall_s": time.perf_counter() - started}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup-steps", type=int, default=3, help="steps left out of tokens/s")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--tokens-per-step", type=int, default=8192)
    parser.add_argument("--max-files", type=int, default=60, help="standard-library modules to read")
    parser.add_argument("--workdir", default=None, help="default: a temporary directory")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    with tempfile.TemporaryDirectory(prefix="dcp-demo-") as tmp:
        workdir = args.workdir or tmp
        os.makedirs(workdir, exist_ok=True)
        prefix = os.path.join(workdir, "stdlib")
        print("== building the demo dataset from the Python standard library", flush=True)
        build_dataset(prefix, args.max_files)
        dcp = train("dcp", prefix, args, ["--dcp"])
        static = train("static-cp2", prefix, args, ["--context-parallel-size", "2"])
    print("\n== result (2 CPU ranks, same global batches, tokens/s without the first "
          f"{args.warmup_steps} steps)")
    print(f"  DCP         {dcp['tokens_per_s']:9.0f} tokens/s measured, {dcp['predicted_tokens_per_s']:9.0f} "
          f"predicted by the cost model   (run {dcp['wall_s']:.0f} s)")
    print(f"  static CP=2 {static['tokens_per_s']:9.0f} tokens/s measured, {static['predicted_tokens_per_s']:9.0f} "
          f"predicted by the cost model   (run {static['wall_s']:.0f} s)")
    print(f"  DCP / static CP=2 = {dcp['tokens_per_s'] / static['tokens_per_s']:.2f}x measured, "
          f"{dcp['predicted_tokens_per_s'] / static['predicted_tokens_per_s']:.2f}x predicted")
    print("  (the two runs train on identical batches, so their loss columns match; on a machine shared with "
          "other jobs, measured rates drift with its load)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
