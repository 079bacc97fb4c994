#!/usr/bin/env python
"""Measured throughput of the planned-step loop users run on 2 CPU ranks: static CP=2 vs the dcp plan.

    .venv/bin/python tools/bench_runtime.py --json bench_runtime.json [--steps 8] [--tokens-per-step 8192]

Two gloo ranks (one thread each) train gpt-tiny (TinyGPT with the gpt-tiny ModelShape) on the
same global batches through dcp_megatron/core/step_loop.py (planning one step ahead, plan agreement, the
document exchange, the micro-batch dicts; the test harness's reference engine, tests/support/reference/, in
place of Megatron's schedule) under two plans, both scored with the `cpu` ClusterSpec (or --profile):
- static: the planner's `static` policy, the layout fixed for the run from the length cap
  (it picks CP=2 for every sequence here, since a cap-length document does not fit on one rank);
- dcp: the planner's `dcp` policy, per batch.
Batches: long-tailed lengths from the built-in Wikipedia-like distribution, truncated at the
cap (the longest document the model's memory allows on the 2-rank domain, at most
--max-seq-len), cut into global batches in stream order; and uniform batches of cap-length
documents, where dcp has nothing to exploit and must not lose. Both plans run every batch back to
back, in alternating order (static first on even steps, dcp first on odd ones), so machine-load
drift hits both alike; the first batch of each kind is a warm-up and is not timed. Steps are
CPU-sized (a second or two) so that many of them fit in a few minutes and the noise of a shared
machine averages out.

Prints per-step times next to the plans' predictions, tokens/s per (kind, policy) over the timed
steps, and ratio_longtail / ratio_uniform: dcp tokens/s over static tokens/s, both summed over the
timed batches (a batch weighs by its time, as in a training run). Next to them, `*_median`: the
median over batches of the per-batch ratio, robust to a step that another job slowed down but
blind to which batches dominate the time. --json writes them. Before training it prints, for the
same batches, the cost model's view: `predicted` (static / dcp estimates) and `ceiling` (static's
estimate / the memory-aware lower bound: the most any plan could gain), summed and median.
--predict-only stops there (seconds); with --mem-per-rank-mib (the modelled budget, which sets the
cap and what needs recompute or CP=2) and --tokens-per-step it shows how much a 2-rank domain can
gain in each memory regime; tools/runtime_headroom.py sweeps a grid of them.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dcp_megatron.planner.batcher import GlobalBatcher  # noqa: E402
from dcp_megatron.planner.costmodel import CostModel, cpu_cluster, load_profile, model_preset  # noqa: E402
from dcp_megatron.planner.costmodel.cluster_cpu import CPU_MEM_BYTES_PER_RANK  # noqa: E402
pass  # noqa: E402
pass  # noqa: E402
from dcp_megatron.planner.distributions import builtin_lengths  # noqa: E402
pass  # noqa: E402
from dcp_megatron.planner.policies import make_plan  # noqa: E402
from dcp_megatron.planner.baselines.static import static_layout  # noqa: E402
from dcp_megatron.runtime.group_pool import GroupPool  # noqa: E402
from tests.support.reference.parity import ReferenceRun  # noqa: E402
from tests.support.reference.single_process import seeded_tokens  # noqa: E402
from tests.support.reference.tiny_gpt import TinyGPT, TinyGPTConfig  # noqa: E402
from local_ranks import run_local_ranks  # noqa: E402

WORLD = 2
POLICIES = ("static", "dcp")
MODEL = "gpt-tiny"


def cost_model(mem_per_rank_mib: float, profile=None) -> CostModel:
    """gpt-tiny on the `cpu` preset's 2 ranks, with this modelled memory budget per rank."""
    cluster = dataclasses.replace(cpu_cluster(WORLD), mem_bytes_per_gpu=int(mem_per_rank_mib * 2 ** 20))
    return CostModel(model_preset(MODEL), cluster, profile=profile)


def memory_cap(cost: CostModel, limit: int) -> int:
    """Longest single document (<= limit) that fits on the whole domain with some recompute."""
    lo, hi = 1, limit
    if cost.best_recompute([hi], cost.cluster.domain_size) is not None:
        return hi
    if cost.best_recompute([lo], cost.cluster.domain_size) is None:
        raise ValueError(f"{cost.cluster.mem_bytes_per_gpu / 2 ** 20:g} MiB per rank holds no document at all "
                         f"(the model's weights, gradients and optimizer state alone exceed it); give each rank "
                         f"more memory (--mem-per-rank-mib)")
    while lo < hi - 1:
        mid = (lo + hi) // 2
        if cost.best_recompute([mid], cost.cluster.domain_size) is not None:
            lo = mid
        else:
            hi = mid
    return lo


def make_batches(args, cap: int) -> dict[str, list[list[tuple[int, int]]]]:
    batcher = GlobalBatcher(tokens_per_step=args.tokens_per_step, max_seq_len=cap, overlong="truncate")
    needed = args.steps + 1
    lengths = builtin_lengths("wikipedia", 64 * needed * max(1, args.tokens_per_step // 1024), args.seed)
    longtail = [list(b.sequences) for _, b in zip(range(needed), batcher.batches(enumerate(lengths)))]
    per_batch = max(1, args.tokens_per_step // cap)
    uniform = [[(step * per_batch + i, cap) for i in range(per_batch)] for step in range(needed)]
    return {"longtail": longtail, "uniform": uniform}


def make_plans(batches, cost: CostModel, cap: int) -> dict[str, list[dict]]:
    """Both policies' plans of every batch, made once here; the ranks run exactly these."""
    return {kind: [{policy: make_plan(policy, batch, cost, max_seq_len=cap) for policy in POLICIES}
                   for batch in kind_batches] for kind, kind_batches in batches.items()}


def predicted_ratios(plans) -> dict:
    """What the cost model says of the timed batches: static / dcp (`predicted`) and static / the
    memory-aware lower bound (`ceiling`: no plan can gain more than this), over summed seconds
    (= tokens/s over all timed batches) and as the median of the per-batch ratios."""
    out = {}
    for kind, steps in plans.items():
        timed = steps[1:]
        static_s = sum(p["static"].est_step_time_s for p in timed)
        out[f"ratio_{kind}_predicted"] = static_s / sum(p["dcp"].est_step_time_s for p in timed)
        out[f"ratio_{kind}_ceiling"] = static_s / sum(p["static"].lower_bound_s for p in timed)
        out[f"ratio_{kind}_predicted_median"] = statistics.median(
            p["static"].est_step_time_s / p["dcp"].est_step_time_s for p in timed)
        out[f"ratio_{kind}_ceiling_median"] = statistics.median(
            p["static"].est_step_time_s / p["static"].lower_bound_s for p in timed)
    return out


def bench_rank(rank: int, world_size: int, args, cap: int, batches, cost: CostModel) -> list[dict]:
    pool = GroupPool([list(range(WORLD))], timeout=timedelta(seconds=900))
    model = TinyGPT(TinyGPTConfig.from_shape(model_preset(MODEL)), seed=0)
    tokens_of = seeded_tokens(model.config.vocab_size, args.seed)
    rows = []
    for kind, kind_batches in batches.items():
        # one loop per policy over the same batches, as a training run would plan them (one step ahead)
        runs = {policy: ReferenceRun(model, pool, kind_batches, tokens_of, cost=cost, seq_length=cap,
                                     plan_function=lambda sequences, cost, policy=policy: make_plan(
                                         policy, sequences, cost, max_seq_len=cap))
                for policy in POLICIES}
        for step, batch in enumerate(kind_batches):
            for policy in (POLICIES if step % 2 == 0 else POLICIES[::-1]):
                cpu_start = time.process_time()
                result = runs[policy].step()
                plan = runs[policy].last_plan
                # Busiest rank's CPU seconds: the step time on dedicated cores, less the waits.
                busy = torch.tensor([time.process_time() - cpu_start], dtype=torch.float64)
                dist.all_reduce(busy, op=dist.ReduceOp.MAX)
                model.zero_grad(set_to_none=True)
                stats = result.stats
                rows.append({"kind": kind, "step": step, "policy": policy, "timed": step > 0,
                             "tokens": sum(n for _, n in batch), "step_s": stats.step_s,
                             "busy_cpu_s": float(busy),
                             "predicted_s": stats.predicted_step_s, "lower_bound_s": plan.lower_bound_s,
                             "imbalance": stats.imbalance,
                             "predicted_imbalance": stats.predicted_imbalance,
                             "cp_sizes": plan.cp_size_histogram(), "summary": plan.summary()})
                if rank == 0:
                    print(f"{kind:8s} step {step} {policy:6s} {stats.step_s:7.2f} s (plan {stats.predicted_step_s:6.2f})"
                          f" cpu {float(busy):6.2f} s imbalance {stats.imbalance:.2f}  {plan.summary()}", flush=True)
        for run in runs.values():
            run.close()
    return rows


def summarize(rows: list[dict]) -> dict:
    tput, out = {}, {}
    for kind in ("longtail", "uniform"):
        step_s, busy_s = {}, {}
        for policy in POLICIES:
            timed = [r for r in rows if r["kind"] == kind and r["policy"] == policy and r["timed"]]
            tput[f"{kind}/{policy}"] = sum(r["tokens"] for r in timed) / sum(r["step_s"] for r in timed)
            step_s[policy] = {r["step"]: r["step_s"] for r in timed}
            busy_s[policy] = {r["step"]: r["busy_cpu_s"] for r in timed}
        per_step = [step_s["static"][s] / step_s["dcp"][s] for s in sorted(step_s["dcp"])]
        out[f"ratio_{kind}"] = tput[f"{kind}/dcp"] / tput[f"{kind}/static"]
        out[f"ratio_{kind}_median"] = statistics.median(per_step)
        # Diagnostic, not the target: the same ratio from the busiest rank's CPU time per step.
        out[f"ratio_{kind}_cpu_time"] = statistics.median(busy_s["static"][s] / busy_s["dcp"][s]
                                                          for s in sorted(busy_s["dcp"]))
        out[f"ratio_{kind}_per_step"] = per_step
    return {"tokens_per_s": tput, **out}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write results here")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per kind (plus one warm-up)")
    parser.add_argument("--tokens-per-step", type=int, default=8192)
    parser.add_argument("--max-seq-len", type=int, default=4096, help="upper bound of the length cap")
    parser.add_argument("--profile", help="cost-model profile JSON (tools/profile_cpu.py) instead of the preset")
    parser.add_argument("--mem-per-rank-mib", type=float, default=CPU_MEM_BYTES_PER_RANK / 2 ** 20,
                        help="the modelled memory budget per rank (the cpu preset's by default); it sets the cap and "
                             "which documents need recompute or CP=2")
    parser.add_argument("--predict-only", action="store_true",
                        help="plan the batches and print the cost model's ratios, without training")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.tokens_per_step < 1 or args.max_seq_len < 2 or args.mem_per_rank_mib <= 0:
        parser.error("--steps, --tokens-per-step must be >= 1, --max-seq-len >= 2, --mem-per-rank-mib > 0")
    cost = cost_model(args.mem_per_rank_mib, load_profile(args.profile) if args.profile else None)
    try:
        cap = memory_cap(cost, min(args.max_seq_len, args.tokens_per_step))
    except ValueError as err:
        parser.error(str(err))
    batches = make_batches(args, cap)
    plans = make_plans(batches, cost, cap)
    predicted = predicted_ratios(plans)
    print(f"{MODEL} on {WORLD} CPU ranks, {args.mem_per_rank_mib:g} MiB per rank, cap {cap} tokens, "
          f"{args.tokens_per_step} tokens/step, {args.steps} timed steps per kind", flush=True)
    layout = static_layout(cost, cap)
    print(f"static layout: CP={layout.cp_size} for every sequence, recompute {layout.recompute}", flush=True)
    for kind in ("longtail", "uniform"):
        print(f"predicted ratio_{kind}={predicted[f'ratio_{kind}_predicted']:.3f} "
              f"(ceiling: static / lower bound = {predicted[f'ratio_{kind}_ceiling']:.3f}); median over batches: "
              f"predicted {predicted[f'ratio_{kind}_predicted_median']:.3f}, "
              f"ceiling {predicted[f'ratio_{kind}_ceiling_median']:.3f}", flush=True)
    if args.predict_only:
        return 0
    try:
        rows = run_local_ranks(bench_rank, WORLD, args, cap, batches, cost, timeout_s=3600)[0]
    except RuntimeError as err:
        print(f"a rank failed; no results\n{err}", file=sys.stderr)
        return 1
    summary = {**summarize(rows), **predicted}
    for name, value in summary["tokens_per_s"].items():
        print(f"tokens/s {name:18s} {value:9.1f}")
    for kind, target in (("longtail", 1.3), ("uniform", 0.97)):
        steps = " ".join(f"{r:.2f}" for r in summary[f"ratio_{kind}_per_step"])
        print(f"ratio_{kind}={summary[f'ratio_{kind}']:.3f} (summed tokens/s; target >= {target}); per batch "
              f"[{steps}], median {summary[f'ratio_{kind}_median']:.3f}; median from CPU time: "
              f"{summary[f'ratio_{kind}_cpu_time']:.3f}; predicted {summary[f'ratio_{kind}_predicted']:.3f}, "
              f"ceiling {summary[f'ratio_{kind}_ceiling']:.3f}")
    if args.json:
        out = {"config": {"model": MODEL, "world": WORLD, "mem_per_rank_mib": args.mem_per_rank_mib, "cap": cap, "tokens_per_step": args.tokens_per_step,
                          "steps": args.steps, "seed": args.seed, "profile": args.profile,
                          "time": time.strftime("%Y-%m-%d %H:%M:%S")},
               **summary, "steps": rows}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
