#!/usr/bin/env python3
"""The CPU demo: `--dcp` inside Megatron's own training loop vs Megatron's static layout, on real text.

  .venv/bin/python tools/demo.py            (what `make demo` runs; 4-6 min on 2 cores)

1. Builds a small real-text dataset from the Python standard library's own sources
   (tools/make_demo_data.py: one document per top-level definition, byte tokenizer, EOD 256):
   document lengths are long-tailed like a pretraining corpus.
2. Trains a small GPT (4 layers, hidden 128, GQA 4/2 heads, RoPE, SwiGLU, RMSNorm) with
   pretrain_scripts/pretrain_gpt.py through megatron.training's loop on 2 CPU ranks (gloo),
   Megatron's GPT dataset with documents separated (--dataloader-inter-document-masking), twice
   on identical global batches: with `--dcp` (each step's lengths decide CP sizes, micro-batches
   and recompute) and with `--dcp --dcp-policy static` (Megatron's static layout: CP 2 for every
   document and the one recompute setting a full-length document needs, run by the same runtime), both
   with 18 MiB of modelled memory per rank (--dcp-memory-budget-gb 0.02).
   Iteration lines stream while the runs go; both print the same loss column.
3. Prints both runs' tokens/s, the measured ratio and the ratio the cost model predicted.
4. For the same documents, prints what the simulator predicts for DCP vs static on 8, 32 and 64
   H200s (Llama-3-8B; modelled, not measured) and draws the ratios to demo_out/h200_model.png.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MEGATRON_LINE = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*?elapsed time per iteration \(ms\): ([\d.]+) \|"
                           r".*?lm loss: (\S+) \|")
DCP_LINE = re.compile(r" dcp iteration\s+(\d+) \| plan (\S+): waves (\d+) \| cp sizes (\S+) \| "
                      r"micro-batches/rank (\S+) .*?\| recompute (\S+) \| predicted \(ms\): ([\d.]+) \| "
                      r"forward-backward \(ms\): ([\d.]+)")
CPU_FLAGS = ("--transformer-impl local --use-cpu-initialization --distributed-backend gloo "
             "--no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-gelu-fusion "
             "--no-bias-dropout-fusion --no-rope-fusion --no-persist-layer-norm").split()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def build_dataset(prefix: str, max_files: int) -> None:
    import make_demo_data  # tools/ is on sys.path when run as a script

    if make_demo_data.main(["--output-prefix", prefix, "--max-files", str(max_files)]) != 0:
        raise SystemExit("demo: building the dataset failed")


def model_flags(args: argparse.Namespace) -> list[str]:
    return ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--group-query-attention",
            "--num-query-groups", "2", "--ffn-hidden-size", "384", "--swiglu", "--disable-bias-linear",
            "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
            "--seq-length", str(args.seq_length), "--max-position-embeddings", str(args.seq_length),
            "--micro-batch-size", "1", "--global-batch-size", str(args.global_batch_size)]


def train(label: str, prefix: str, args: argparse.Namespace, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(_free_port()), os.path.join(ROOT, "pretrain_scripts", "pretrain_gpt.py"),
           *model_flags(args), "--data-path", prefix, "--split", "100,0,0", "--tokenizer-type", "NullTokenizer",
           "--vocab-size", "257", "--dataloader-inter-document-masking", "--calculate-per-token-loss",
           "--train-iters", str(args.steps), "--eval-iters", "0", "--eval-interval", str(args.steps), "--lr", "3e-3", "--lr-warmup-iters", "3",
           "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--seed", "1234",
           "--attention-dropout", "0", "--hidden-dropout", "0", "--log-interval", "1", *CPU_FLAGS, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=ROOT,
               CUDA_DEVICE_MAX_CONNECTIONS="1")
    print(f"\n== {label}: {' '.join(extra)}", flush=True)
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    steps: dict[int, dict] = {}
    tail: list[str] = []
    for line in proc.stdout:
        tail = (tail + [line])[-60:]
        plan = DCP_LINE.search(line)
        if plan:
            it = int(plan[1])
            steps.setdefault(it, {}).update(predicted_ms=float(plan[7]), plan=(
                f"waves {plan[3]} {plan[4]} mb/rank {plan[5]} recompute {plan[6]}"))
        done = MEGATRON_LINE.search(line)
        if done:
            it = int(done[1])
            step = steps.setdefault(it, {})
            step.update(ms=float(done[3]), loss=float(done[4]))
            print(f"  [{label}] step {it:3d}/{done[2]}  loss {step['loss']:.6f}  {step['ms']:7.1f} ms "
                  f"(predicted {step.get('predicted_ms', 0):6.1f})  {step.get('plan', '')}", flush=True)
    if proc.wait() != 0:
        sys.stdout.write("".join(tail))
        raise SystemExit(f"demo: the {label} run failed (exit {proc.returncode})")
    # The first steps include warm-up (allocator, group creation): leave them out of the rate.
    timed = [steps[i] for i in sorted(steps) if i > args.warmup_steps and "ms" in steps[i]]
    tokens = len(timed) * args.global_batch_size * args.seq_length
    return {"tokens_per_s": tokens / (sum(s["ms"] for s in timed) / 1000),
            "predicted_tokens_per_s": tokens / (sum(s["predicted_ms"] for s in timed) / 1000),
            "losses": [steps[i]["loss"] for i in sorted(steps) if "loss" in steps[i]],
            "wall_s": time.perf_counter() - started}


def modelled_h200(lengths_file: str, out_dir: str) -> list[tuple[int, float, float]]:
    """DCP vs static (and vs the best baseline) on 8/32/64 H200s, Llama-3-8B, by the simulator."""
    rows = []
    for gpus in (8, 32, 64):
        out = os.path.join(out_dir, f"sim_{gpus}.json")
        cmd = [sys.executable, os.path.join(ROOT, "tools", "simulate.py"), "--lengths", lengths_file,
               "--model", "llama3-8b", "--cluster", "h200", "--gpus", str(gpus),
               "--tokens-per-step", str(gpus * 16384), "--steps", "8", "--json", out]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
        if proc.returncode != 0:
            raise SystemExit(f"demo: the simulator failed:\n{proc.stdout}{proc.stderr}")
        report = json.load(open(out))
        dcp = report["policies"]["dcp"]
        rows.append((gpus, float(dcp["speedup_vs_static"]), float(dcp["speedup_vs_best_baseline"])))
    return rows


def plot(rows, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    gpus = [r[0] for r in rows]
    ax.plot(gpus, [r[1] for r in rows], "o-", label="DCP vs static")
    ax.plot(gpus, [r[2] for r in rows], "s--", label="DCP vs best baseline")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(gpus, [str(g) for g in gpus])
    ax.set_xlabel("H200 GPUs (modelled)")
    ax.set_ylabel("tokens/s ratio")
    ax.set_title("Llama-3-8B on the demo's documents (cost model)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup-steps", type=int, default=3, help="steps left out of tokens/s")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--global-batch-size", type=int, default=4, help="samples of --seq-length per step")
    parser.add_argument("--max-files", type=int, default=60, help="standard-library modules to read")
    parser.add_argument("--memory-budget-gb", type=float, default=0.02,
                        help="modelled memory per rank (GiB): 0.02 holds ~490 local tokens without recompute, so a "
                             "full-length document needs CP 2 and recompute, as long documents do on real GPUs")
    parser.add_argument("--out", default=os.path.join(ROOT, "demo_out"), help="where the plot and JSON go")
    parser.add_argument("--profile", default=None, metavar="PROFILE.json",
                        help="plan both runs with this measured profile (tools/profile.py on the demo's model flags)")
    args = parser.parse_args(argv)
    if args.profile is not None and not os.path.isfile(args.profile):
        parser.error(f"--profile {args.profile}: no such file")
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dcp-demo-") as tmp:
        prefix = os.path.join(tmp, "stdlib")
        print("== building the demo dataset from the Python standard library", flush=True)
        build_dataset(prefix, args.max_files)
        budget = ["--dcp-memory-budget-gb", str(args.memory_budget_gb)]
        if args.profile is not None:
            budget += ["--dcp-profile", os.path.abspath(args.profile)]
        dcp = train("dcp", prefix, args, ["--dcp", *budget])
        static = train("static", prefix, args, ["--dcp", "--dcp-policy", "static", *budget])
        lengths_file = os.path.join(args.out, "demo_document_lengths.txt")
        from dcp_megatron.megatron.indexed_documents import IndexedDocuments
        with open(lengths_file, "w") as f:
            f.write("\n".join(str(n) for n in IndexedDocuments(prefix).lengths()) + "\n")
    # Same batches, exact gradients: equal up to float summation order (7 significant digits printed).
    same = len(dcp["losses"]) == len(static["losses"]) and all(
        abs(a - b) <= 1e-5 * abs(b) for a, b in zip(dcp["losses"], static["losses"]))
    print("\n== result (2 CPU ranks, megatron.training's loop, identical global batches, tokens/s without the "
          f"first {args.warmup_steps} steps)")
    for label, run in (("DCP   ", dcp), ("static", static)):
        print(f"  {label} {run['tokens_per_s']:9.0f} tokens/s measured, {run['predicted_tokens_per_s']:9.0f} "
              f"predicted by the cost model   (run {run['wall_s']:.0f} s)")
    print(f"  DCP / static = {dcp['tokens_per_s'] / static['tokens_per_s']:.2f}x measured, "
          f"{dcp['predicted_tokens_per_s'] / static['predicted_tokens_per_s']:.2f}x predicted; loss columns "
          f"{'equal (within 1e-5)' if same else 'DIFFER'}")
    rows = modelled_h200(lengths_file, args.out)
    print("\n== modelled (cost model, not measured): the same documents, Llama-3-8B, 16,384 tokens per GPU per step")
    for gpus, vs_static, vs_best in rows:
        print(f"  {gpus:3d} x H200: DCP vs static {vs_static:.2f}x, vs best baseline {vs_best:.2f}x")
    png = os.path.join(args.out, "h200_model.png")
    plot(rows, png)
    print(f"  plot: {png}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
