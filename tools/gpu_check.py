"""The prepared check for one NVIDIA GPU (an H100 or an H200): what of the GPU path can run on one device, in < 8 min.

    tools/gpu_check.sh [--out DIR] [--profiles DIR] [--python PY] [--skip STEP,...] [--dry-run]

Steps (each its own process, so one failure cannot take the report down; the report is DIR/gpu_check.json):
  te_attention   Transformer Engine's THD attention (bf16, causal, CP 1) vs our attention
                 (runtime.cp_attention.packed_causal_attention, fp32) on our zig-zag shard layout: forward and
                 backward, max error relative to max |reference| <= 2e-2; then the device memory one NCCL
                 communicator takes (a 1-rank group: a lower bound of what the planner reserves per group).
  train_bf16     a 1-rank `--dcp` run of pretrain_scripts/pretrain_gpt.py with the TE layer spec in bf16 and a
                 memory budget (computed from the cost model) under which long documents need full recompute and
                 short ones none: passes when it trains with finite losses and its plans switch recompute.
  train_fp8      the same with --fp8-format hybrid --fp8-recipe tensorwise (rows aligned to 16 per micro-batch).
  offload        activation offload per micro-batch (tools/gpu_check_offload.py): DCP steps of a small TE-spec GPT
                 built with --offload-modules core_attn attn_proj, through DCP's step path and megatron-core's
                 schedule, whose micro-batches offload on some and not others: loss and every gradient as with
                 no relief (<= 1e-2 relative), and the peak allocated memory of an all-offload step below none's.
  memory         the planner's memory count on the TE spec (bf16) against the allocator (tools/gpu_check_memory.py):
                 one micro-batch per relief (none, module recompute, full 1/2/4, offload), its peak allocated
                 bytes above the step's start vs the count; passes when each is within the safety margin. Its
                 log and memory.json also hold the memory probe's table (what --dcp-memory-probe reads before step
                 1 per relief: counted vs measured, and the factor it would set) and the device as a run reads it
                 at start: name, total / free memory, what the process holds, the preset and default budget chosen.
  profile_bf16, profile_fp8
                 `dcp-profile` of a mid-sized model on the TE spec: GEMM rate, attention times by length;
                 written to PROFILES/<preset>_bf16.json and <preset>_fp8.json, merged into PROFILES/<preset>.json
                 (<preset>: the device's cluster preset, planner/costmodel/device_budget.py: h100-sxm, h200, ...)
                 (bf16 constants + the FP8 run's GEMM rate as fp8_gemm_flops).
CP > 1 is not checked: one GPU cannot run it (NCCL refuses two ranks on one device); the report says so.
--dry-run prints the steps and their commands as JSON and runs nothing (works without a GPU).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = ("te_attention", "train_bf16", "train_fp8", "offload", "memory", "profile_bf16", "profile_fp8")
NOT_CHECKED = ("CP > 1 (TE's p2p ring over per-micro-batch groups, the per-device CP stream on several GPUs, NCCL "
               "communicator memory of multi-rank groups): one GPU cannot run it, NCCL refuses two ranks on one device")
TOLERANCE = 2e-2
SEQ_LENGTH = 4096   # Megatron's mock documents are 1..4095 tokens long
TRAIN_MODEL = dict(num_layers=4, hidden_size=1024, num_heads=8, num_kv_heads=4, ffn_hidden_size=2816, vocab=32000)
PROFILE_MODEL = dict(num_layers=2, hidden_size=4096, num_heads=32, num_kv_heads=8, ffn_hidden_size=14336, vocab=32000)
FP8_FLAGS = ("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise")
_ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+|nan|inf)", re.IGNORECASE)
_PLAN = re.compile(r" dcp iteration\s+\d+ \|.*?micro-batches/rank (\S+) .*?\| recompute (\S+)")


def model_flags(model: dict, *, train_iters: int) -> list[str]:
    """Megatron flags of a Llama-like model on the TE spec, mock data, bf16, --dcp (one GPU)."""
    return [
        "--num-layers", str(model["num_layers"]), "--hidden-size", str(model["hidden_size"]),
        "--num-attention-heads", str(model["num_heads"]), "--group-query-attention",
        "--num-query-groups", str(model["num_kv_heads"]), "--ffn-hidden-size", str(model["ffn_hidden_size"]),
        "--seq-length", str(SEQ_LENGTH), "--max-position-embeddings", str(SEQ_LENGTH),
        "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", str(train_iters),
        "--position-embedding-type", "rope", "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
        "--untie-embeddings-and-output-weights", "--use-distributed-optimizer", "--calculate-per-token-loss",
        "--lr", "1e-4", "--min-lr", "1e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
        "--clip-grad", "1.0", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(model["vocab"]),
        "--split", "98,1,1", "--eval-iters", "1", "--eval-interval", "1000", "--dataloader-inter-document-masking",
        "--attention-dropout", "0",
        "--hidden-dropout", "0", "--log-interval", "1", "--seed", "1234", "--bf16",
        "--transformer-impl", "transformer_engine", "--distributed-timeout-minutes", "5", "--dcp",
    ]


def recompute_switching_budget_gb(model: dict, *, fp8: bool) -> float:
    """A --dcp-memory-budget-gb under which a SEQ_LENGTH document needs full recompute at CP 1 and one of
    a quarter of that needs none (the planner's own memory model, as the run builds it on GPU)."""
    sys.path.insert(0, REPO)
    from dcp_megatron.planner.costmodel import CostModel, GpuCosts, ModelShape, cluster_preset
    from dcp_megatron.planner.plan import NO_RECOMPUTE, Recompute

    shape = ModelShape(num_layers=model["num_layers"], hidden_size=model["hidden_size"], num_heads=model["num_heads"],
                       num_kv_heads=model["num_kv_heads"], head_dim=model["hidden_size"] // model["num_heads"],
                       ffn_hidden_size=model["ffn_hidden_size"], vocab_size=-(-(model["vocab"] + 1) // 128) * 128,
                       gated_mlp=True, tp=1, pp=1)
    cost = CostModel(shape, cluster_preset("h200", domain_size=1),
                     gpu=GpuCosts(fp8=fp8, cp_ring=True, communicators=True))
    full = cost.microbatch_memory([SEQ_LENGTH], 1, recompute=Recompute("full", model["num_layers"]))
    none = cost.microbatch_memory([SEQ_LENGTH], 1, recompute=NO_RECOMPUTE)
    quarter = cost.microbatch_memory([SEQ_LENGTH // 4], 1, recompute=NO_RECOMPUTE)
    needed = max(full, quarter) + 0.25 * (none - max(full, quarter))   # between: the long one needs recompute
    return round(needed / (1.0 - cost.cluster.mem_safety_frac) / 2 ** 30, 3)


def build_steps(*, out: str, profiles: str, python: str, preset: str = "h200") -> list[dict]:
    """Every step: name, argv, timeout (s), and where its log goes."""
    torchrun = [python, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--standalone"]
    script = os.path.join(REPO, "pretrain_scripts", "pretrain_gpt.py")
    steps = [dict(name="te_attention", argv=[python, os.path.abspath(__file__), "--probe", out], timeout_s=120)]
    for name, extra in (("train_bf16", []), ("train_fp8", list(FP8_FLAGS))):
        budget = recompute_switching_budget_gb(TRAIN_MODEL, fp8=bool(extra))
        steps.append(dict(name=name, timeout_s=150, argv=[
            *torchrun, script, *model_flags(TRAIN_MODEL, train_iters=6), *extra, "--dcp-recompute", "none,full",
            "--dcp-memory-budget-gb", str(budget), "--dcp-dump-plans", os.path.join(out, f"{name}_plans")]))
    steps.append(dict(name="offload", timeout_s=180,
                      argv=[python, os.path.join(REPO, "tools", "gpu_check_offload.py"), out]))
    steps.append(dict(name="memory", timeout_s=180,
                      argv=[python, os.path.join(REPO, "tools", "gpu_check_memory.py"), out]))
    for name, extra in (("profile_bf16", []), ("profile_fp8", list(FP8_FLAGS))):
        target = os.path.join(profiles, f"{preset}_{name.split('_')[1]}.json")
        steps.append(dict(name=name, timeout_s=150, profile=target, argv=[
            python, "-m", "dcp_megatron.profile", "--nproc", "1", "--repeats", "2", "--clock", "wall",
            "--out", target, "--report", os.path.join(out, f"{name}_report.json"), "--",
            *model_flags(PROFILE_MODEL, train_iters=10), *extra]))
    for step in steps:
        step["log"] = os.path.join(out, f"{step['name']}.log")
    return steps


def judge(step: dict, rc: int, log: str) -> dict:
    """What a finished step showed, and whether it passed."""
    result: dict = {"rc": rc}
    if step["name"] in ("te_attention", "offload", "memory"):
        probe = os.path.join(os.path.dirname(step["log"]), f"{step['name']}.json")
        if os.path.isfile(probe):
            with open(probe) as f:
                result.update(json.load(f))
        if step["name"] == "te_attention":
            result["passed"] = rc == 0 and result.get("max_rel_error", math.inf) <= TOLERANCE
        else:   # the probe judged itself (tools/gpu_check_offload.py, tools/gpu_check_memory.py)
            result["passed"] = rc == 0 and result.get("passed") is True
    elif step["name"].startswith("train_"):
        losses = [float(x) for _, x in _ITERATION.findall(log)]
        steps = []   # (micro-batches, recomputed ones) per step
        for counts, summary in _PLAN.findall(log):
            recomputed = 0 if summary == "none" else sum(int(p.rsplit("x", 1)[1]) for p in summary.split(","))
            steps.append((sum(int(c) for c in counts.split("/")), recomputed))
        # switching: a step whose micro-batches differ, or steps with and without recompute
        switching = (any(0 < r < n for n, r in steps)
                     or (any(r == 0 for _, r in steps) and any(r > 0 for _, r in steps)))
        result.update(losses=losses, microbatches_and_recomputed_per_step=steps, recompute_switched=switching)
        result["passed"] = (rc == 0 and bool(losses) and all(math.isfinite(x) for x in losses) and switching)
    else:
        result["passed"] = rc == 0 and os.path.isfile(step["profile"])
        if result["passed"]:
            with open(step["profile"]) as f:
                result["gemm_flops"] = json.load(f).get("gemm_flops")
    return result


def merge_profiles(profiles: str, preset: str = "h200") -> str | None:
    """PROFILES/<preset>.json: the bf16 profile with the FP8 profile's GEMM rate as fp8_gemm_flops."""
    paths = [os.path.join(profiles, f"{preset}_{p}.json") for p in ("bf16", "fp8")]
    if not all(map(os.path.isfile, paths)):
        return None
    bf16, fp8 = (json.load(open(p)) for p in paths)
    bf16["fp8_gemm_flops"] = fp8["gemm_flops"]
    bf16.setdefault("meta", {})["fp8_from"] = os.path.basename(paths[1])
    merged = os.path.join(profiles, f"{preset}.json")
    with open(merged, "w") as f:
        json.dump(bf16, f, indent=1)
    return merged


def run(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: error: no GPU visible to torch; run on a GPU machine (or use --dry-run)", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.profiles, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    sys.path.insert(0, REPO)
    from dcp_megatron.planner.costmodel.device_budget import preset_for_device

    preset, note = preset_for_device(torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory)
    report = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "gpu": torch.cuda.get_device_name(0),
              "preset": preset, "versions": _versions(), "not_checked": NOT_CHECKED, "steps": {}}
    print(f"gpu_check: {report['gpu']}: preset {preset}" + (f" ({note})" if note else ""), flush=True)
    started = time.monotonic()
    for step in build_steps(out=args.out, profiles=args.profiles, python=args.python, preset=preset):
        if step["name"] in args.skip:
            report["steps"][step["name"]] = {"skipped": True}
            continue
        t0 = time.monotonic()
        with open(step["log"], "w") as log:
            try:
                rc = subprocess.run(step["argv"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    timeout=step["timeout_s"]).returncode
            except subprocess.TimeoutExpired:
                rc = 124
        text = open(step["log"], errors="replace").read()
        result = judge(step, rc, text)
        result["seconds"] = round(time.monotonic() - t0, 1)
        if not result["passed"]:
            result["log_tail"] = text[-2000:]
        report["steps"][step["name"]] = result
        verdict = "PASS" if result["passed"] else "FAIL"
        print(f"gpu_check: {step['name']}: {verdict} ({result['seconds']} s)", flush=True)
    report["merged_profile"] = merge_profiles(args.profiles, preset)
    report["seconds"] = round(time.monotonic() - started, 1)
    report["passed"] = all(r.get("passed") or r.get("skipped") for r in report["steps"].values())
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"gpu_check: {'PASS' if report['passed'] else 'FAIL'}; report {os.path.join(args.out, 'gpu_check.json')}")
    return 0 if report["passed"] else 1


def _versions() -> dict:
    import importlib.metadata as md

    import torch

    found = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for dist in ("megatron-core", "transformer-engine", "transformer_engine", "deepspeed"):
        try:
            found[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(REPO, "gpu_check_out"), help="logs and gpu_check.json")
    parser.add_argument("--profiles", default=os.path.join(REPO, "profiles"), help="where <preset>_*.json are written")
    parser.add_argument("--python", default=sys.executable, help="the Python of the GPU environment")
    parser.add_argument("--skip", default="", help=f"comma list of steps to skip, from {','.join(STEPS)}")
    parser.add_argument("--dry-run", action="store_true", help="print the steps as JSON; run nothing")
    parser.add_argument("--probe", metavar="DIR", help=argparse.SUPPRESS)   # the te_attention step itself
    args = parser.parse_args(argv)
    if args.probe:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from gpu_check_probe import probe

        return probe(args.probe)
    args.skip = tuple(s for s in args.skip.split(",") if s)
    unknown = [s for s in args.skip if s not in STEPS]
    if unknown:
        parser.error(f"--skip: unknown steps {unknown}; choose from {','.join(STEPS)}")
    if args.dry_run:
        steps = build_steps(out=os.path.abspath(args.out), profiles=os.path.abspath(args.profiles), python=args.python)
        print(json.dumps({"steps": [s for s in steps if s["name"] not in args.skip], "not_checked": NOT_CHECKED},
                         indent=1))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
