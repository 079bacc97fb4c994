#!/usr/bin/env python3
"""The CPU demo: `--dcp` inside Megatron's own training loop vs Megatron's static layout and a tuned
megatron-dynamic, on real text.

  .venv/bin/python tools/demo.py            (what `make demo` runs; three runs of 16 steps)

1. Builds a small real-text dataset from the Python standard library's own sources
   (tools/make_demo_data.py: one document per top-level definition, byte tokenizer, EOD 256):
   document lengths are long-tailed like a pretraining corpus.
2. Tunes megatron-dynamic (Megatron dev's dynamic CP) for the demo's own global batches: the batches
   Megatron's dataset and sampler deal for the runs' flags and the cost model the runtime builds from them,
   swept over planner/baselines/sweep.py's grid (tools/demo_tuning.py); prints the grid and its winner.
   Then trains a small GPT (4 layers, hidden 128, GQA 4/2 heads, RoPE, SwiGLU, RMSNorm) with
   pretrain_scripts/pretrain_gpt.py through megatron.training's loop on 2 CPU ranks (gloo),
   Megatron's GPT dataset with documents separated (--dataloader-inter-document-masking), three times
   on identical global batches: with `--dcp` (each step's lengths decide CP sizes, micro-batches
   and recompute), with `--dcp --dcp-policy static` (Megatron's static layout: CP 2 for every
   document and the one recompute setting a full-length document needs) and with `--dcp --dcp-policy
   megatron-dynamic --dcp-policy-setting <winner>` (tuned), all run by the same runtime with 0.033 GiB
   per rank (--dcp-memory-budget-gb 0.033, real bytes: planner/costmodel/memory_spec.py CPU_FP32).
   The runs are measured under the same conditions: all stay alive and take turns in blocks
   of --block steps (each paused while the others train the same steps, tools/demo_interleave.py),
   so a change in the machine's load hits all; a step whose time spans a pause is left out.
   Iteration lines stream while the runs go; all print the same loss column.
3. Prints each run's tokens/s (measured and predicted) over the steps measured cleanly in all, DCP / static
   and DCP / tuned megatron-dynamic measured with their spread over the blocks, and the cost model's ratios
   as configured (the dcp/predicted_unrefined_s scalar of each run's TensorBoard events). Every run plans
   with --dcp-no-refine: online refinement follows measured times (so it is no independent prediction),
   and a pause can fall inside a step.
4. For the same documents, prints what the simulator predicts for DCP vs static, vs megatron-dynamic
   and vs the best baseline on 8, 32 and 64 H200s (Llama-3-8B; modelled, not measured; every baseline
   tuned by the simulator's sweep, dcp untuned) and draws the ratios to demo_out/h200_model.png.
   `--modelled-only` prints just that table (seconds: no training).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile

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


def command(prefix: str, args: argparse.Namespace, extra: list[str]) -> list[str]:
    # --standalone: the rendezvous store binds a free port itself (no port picked here and bound later)
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
            os.path.join(ROOT, "pretrain_scripts", "pretrain_gpt.py"),
            *training_flags(prefix, args, extra)]


def training_flags(prefix: str, args: argparse.Namespace, extra: list[str]) -> list[str]:
    return [*model_flags(args), "--data-path", prefix, "--split", "100,0,0", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "257", "--dataloader-inter-document-masking", "--calculate-per-token-loss",
            "--train-iters", str(args.steps), "--eval-iters", "0", "--eval-interval", str(args.steps), "--lr", "3e-3",
            "--lr-warmup-iters", "3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--clip-grad", "1.0",
            "--seed", "1234", "--attention-dropout", "0", "--hidden-dropout", "0", "--log-interval", "1", *CPU_FLAGS,
            *extra]


def _iteration(line: str):
    done = MEGATRON_LINE.search(line)
    return (int(done[1]), float(done[3]), float(done[4])) if done else None


def _plan(line: str):
    plan = DCP_LINE.search(line)
    return (int(plan[1]), float(plan[7]), f"waves {plan[3]} {plan[4]} mb/rank {plan[5]} recompute {plan[6]}") \
        if plan else None


def _show(label: str, it: int, step) -> None:
    predicted = f"{step.predicted_ms:6.1f}" if step.predicted_ms is not None else "     -"
    print(f"  [{label:6s}] step {it:3d}  loss {step.loss:.6f}  {step.ms:7.1f} ms (predicted {predicted})  {step.plan}",
          flush=True)


def run_flags(budget: list[str], tuned_setting: str) -> list[tuple[str, list[str]]]:
    """(label, the run's --dcp flags) of the three runs."""
    return [("dcp", ["--dcp", *budget]), ("static", ["--dcp", "--dcp-policy", "static", *budget]),
            ("tuned", ["--dcp", "--dcp-policy", "megatron-dynamic", "--dcp-policy-setting", tuned_setting, *budget])]


def tune(prefix: str, args: argparse.Namespace, budget: list[str]) -> str:
    """megatron-dynamic's grid winner for the demo's own batches and cost model (tools/demo_tuning.py), printed."""
    import logging

    from demo_tuning import tune_megatron_dynamic

    from dcp_megatron.planner.baselines.sweep import format_sweep

    logging.getLogger("megatron").setLevel(logging.WARNING)   # the dataset builder's INFO lines
    result, setting = tune_megatron_dynamic(training_flags(prefix, args, ["--dcp", "--dcp-policy",
                                                                          "megatron-dynamic", *budget]))
    print(f"== tuning megatron-dynamic for these {result.num_batches} global batches (planner/baselines/sweep.py, "
          f"the runs' cost model):\n{format_sweep(result)}\n  winner: --dcp-policy-setting '{setting}'", flush=True)
    return setting


def train_interleaved(prefix: str, args: argparse.Namespace, runs_flags, tb_root: str):
    """The runs, alternating blocks of --block steps (tools/demo_interleave.py)."""
    from demo_interleave import PausedRun, alternate

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=ROOT,
               CUDA_DEVICE_MAX_CONNECTIONS="1")
    runs = []
    for label, extra in runs_flags:
        extra = [*extra, "--tensorboard-dir", os.path.join(tb_root, label)]
        print(f"== {label}: {' '.join(extra)}", flush=True)
        runs.append(PausedRun(label=label, cmd=command(prefix, args, extra), env=env, cwd=ROOT,
                              parse_iteration=_iteration, parse_plan=_plan, on_step=_show))
    alternate(runs, total_steps=args.steps, block=args.block)
    return runs


def unrefined_predictions(tb_dir: str) -> dict[int, float]:
    """dcp/predicted_unrefined_s per step (ms) from the run's TensorBoard events: the plan scored by the
    cost model as configured, beside the refined prediction the log line prints."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(tb_dir, size_guidance={"scalars": 0})
    events.Reload()
    return {e.step: 1000 * e.value for e in events.Scalars("dcp/predicted_unrefined_s")}


def modelled_h200(lengths_file: str, out_dir: str) -> list[tuple[int, float, float]]:
    """DCP vs static, vs megatron-dynamic and vs the best baseline on 8/32/64 H200s, Llama-3-8B, by the simulator."""
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
        dcp, peer = report["policies"]["dcp"], report["policies"]["megatron-dynamic"]
        rows.append((gpus, float(dcp["speedup_vs_static"]), float(dcp["speedup_vs_best_baseline"]),
                     float(dcp["speedup_vs_static"]) / float(peer["speedup_vs_static"])))
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
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup-steps", type=int, default=3, help="steps left out of tokens/s")
    parser.add_argument("--block", type=int, default=3, help="steps each run trains before the next one's turn")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--global-batch-size", type=int, default=4, help="samples of --seq-length per step")
    parser.add_argument("--max-files", type=int, default=60, help="standard-library modules to read")
    parser.add_argument("--memory-budget-gb", type=float, default=0.033,
                        help="memory per rank (GiB, real bytes): 0.033 holds ~450 local tokens without recompute, so "
                             "a full-length document needs CP 2 and recompute, as long documents do on real GPUs")
    parser.add_argument("--out", default=os.path.join(ROOT, "demo_out"), help="where the plot and JSON go")
    parser.add_argument("--modelled-only", action="store_true",
                        help="build the documents and print only the modelled H200 table (no training)")
    parser.add_argument("--profile", default=None, metavar="PROFILE.json",
                        help="plan every run with this measured profile (tools/profile.py on the demo's model flags)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # so the paused runs are ended too (finally)
    if args.profile is not None and not os.path.isfile(args.profile):
        parser.error(f"--profile {args.profile}: no such file")
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dcp-demo-") as tmp:
        prefix = os.path.join(tmp, "stdlib")
        print("== building the demo dataset from the Python standard library", flush=True)
        build_dataset(prefix, args.max_files)
        # --dcp-no-refine: online refinement learns from measured micro-batch times, and here a pause of
        # this run (while the other trains) can fall inside a step; plans then depend on the lengths alone.
        budget = ["--dcp-memory-budget-gb", str(args.memory_budget_gb), "--dcp-no-refine"]
        if args.profile is not None:
            budget += ["--dcp-profile", os.path.abspath(args.profile)]
        lengths_file = os.path.join(args.out, "demo_document_lengths.txt")
        from dcp_megatron.data.indexed_documents import IndexedDocuments
        with open(lengths_file, "w") as f:
            f.write("\n".join(str(n) for n in IndexedDocuments(prefix).lengths()) + "\n")
        if args.modelled_only:
            print_modelled(lengths_file, args.out)
            return 0
        tuned_setting = tune(prefix, args, budget)
        load_before = os.getloadavg()
        runs = train_interleaved(prefix, args, run_flags(budget, tuned_setting), os.path.join(tmp, "tb"))
        load_after = os.getloadavg()
        unrefined = {run.label: unrefined_predictions(os.path.join(tmp, "tb", run.label)) for run in runs}
    same = report(runs, unrefined, args, load_before, load_after)
    print_modelled(lengths_file, args.out)
    return 0 if same else 1


def report(runs, unrefined: dict, args: argparse.Namespace, load_before, load_after) -> bool:
    """tokens/s of each run, dcp vs each baseline measured (with its spread over the blocks) and as the cost
    model predicts it; True when the loss columns agree."""
    from demo_interleave import block_ratios, common_steps

    dcp, baselines = runs[0], runs[1:]
    # Same batches, exact gradients: equal up to float summation order (7 significant digits printed).
    losses = {run.label: [run.steps[i].loss for i in sorted(run.steps)] for run in runs}
    same = all(len(losses[run.label]) == args.steps and all(abs(a - b) <= 1e-5 * abs(b) for a, b in
                                                             zip(losses["dcp"], losses[run.label])) for run in runs)
    common = common_steps(runs, skip=args.warmup_steps)
    if not common:
        raise SystemExit("demo: no step was measured cleanly in every run; raise --steps")
    tokens = len(common) * args.global_batch_size * args.seq_length
    names = {"dcp": "DCP", "static": "static", "tuned": "tuned megatron-dynamic"}
    print(f"\n== result (2 CPU ranks, megatron.training's loop, identical global batches; the {len(runs)} runs "
          f"alternate in blocks of {args.block} steps; {len(common)} steps measured cleanly in all, after the first "
          f"{args.warmup_steps}; load average {load_before[0]:.1f} at the start, {load_after[0]:.1f} at the end)")
    for run in runs:
        measured = tokens / (sum(run.steps[i].ms for i in common) / 1000)
        predicted = tokens / (sum(unrefined[run.label][i] for i in common) / 1000)
        print(f"  {names[run.label]:<23} {measured:9.0f} tokens/s measured, {predicted:9.0f} predicted")
    for base in baselines:
        ratio, per_block = block_ratios(dcp, base, steps=common, block=args.block)
        configured = sum(unrefined[base.label][i] for i in common) / sum(unrefined["dcp"][i] for i in common)
        ordered = sorted(per_block)
        print(f"  DCP / {names[base.label]} = {ratio:.2f}x measured (per block: median "
              f"{ordered[len(ordered) // 2]:.2f}x, min {ordered[0]:.2f}x, max {ordered[-1]:.2f}x over "
              f"{len(ordered)} blocks); predicted {configured:.2f}x")
    print("  (predicted: each run's dcp/predicted_unrefined_s, the cost model as configured; every run plans with "
          "--dcp-no-refine: online refinement would learn from step times that include the other runs' pauses)")
    print(f"  loss columns {'equal (within 1e-5)' if same else 'DIFFER'}")
    return same


def print_modelled(lengths_file: str, out_dir: str) -> None:
    rows = modelled_h200(lengths_file, out_dir)
    print("\n== modelled (cost model, not measured): the same documents, Llama-3-8B, 16,384 tokens per GPU per step; "
          "every baseline tuned (its run-wide setting swept over the same 8 batches), dcp untuned")
    for gpus, vs_static, vs_best, vs_peer in rows:
        print(f"  {gpus:3d} x H200: DCP vs static {vs_static:.2f}x, vs Megatron dev's dynamic CP (megatron-dynamic) "
              f"{vs_peer:.2f}x, vs best baseline {vs_best:.2f}x")
    png = os.path.join(out_dir, "h200_model.png")
    plot(rows, png)
    print(f"  plot: {png}")


if __name__ == "__main__":
    sys.exit(main())
