#!/usr/bin/env python3
"""How far dcp plans sit above the lower bound, per workload; on small instances, also a MILP optimum.

Per workload (built-in length distributions, cut in order into --tokens-per-step global batches, dcp
on --gpus ranks of llama3-8b on h200 by default): dcp step time / lower bound, p50, p95 and max over
--steps steps, and the same binned by each step's longest document (the bins matter for workloads
with a long tail, e.g. bytescale).

With highspy installed, reduced instances follow (dcp_megatron/planner/milp_reference.py): the first
--milp-instances bytescale steps with every length scaled by --milp-scale on --milp-gpus ranks (by
default 16 ranks and 1/4 of each length: the tokens per rank stay, and a document's best CP size is
about the same fraction of the domain as on 64 ranks). For each: lower bound, the MILP's best plan
of the one-long-document-per-micro-batch family (filler divisible) and its dual bound, and dcp.
Where the MILP sits near dcp the plan is about as good as the family allows and the remaining gap
is the bound's; where it sits near the bound, the plan is loose.

Per workload also: dcp over `milp_reference.family_bound` (the LP relaxation of that family on the
full-size steps), which says how much of the gap only other group sizes could close.

`--exact-longest` adds dcp over max(lower bound, the longest document's exact alone time over every group size,
`bounds.exact_alone_time`: the bound's floor leaves CP communication out of the sizes between its grid's, which at
thousands of ranks is most of a long document's time). `--part-ranks N` plans as a run with
`--dcp-plan-part-ranks N` does (planner/dcp/split.py).

Every number printed is measured in this run.
"""
import argparse
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

WORKLOADS = ("wikipedia", "prolong", "lognormal", "bytescale")
BIN_EDGES = (0, 262_144, 524_288, 786_432, 1_048_576, 2_097_152, 2 ** 62)
BIN_NAMES = ("<0.25M", "0.25-0.5M", "0.5-0.75M", "0.75-1M", "1-2M", "2M")


def batches_of(name: str, tokens_per_step: int, steps: int, seed: int):
    from dcp_megatron.planner.batcher import GlobalBatcher
    from dcp_megatron.planner.distributions import iter_builtin_lengths

    batcher = GlobalBatcher(tokens_per_step=tokens_per_step, max_seq_len=tokens_per_step, overlong="split")
    return list(itertools.islice(batcher.batches(enumerate(iter_builtin_lengths(name, seed))), steps))


def summary(ratios) -> dict:
    r = np.asarray(ratios, dtype=np.float64)
    return {"steps": int(r.size), "p50": float(np.percentile(r, 50)), "p95": float(np.percentile(r, 95)),
            "max": float(r.max())}


def measure_workload(name: str, cost, tokens_per_step: int, steps: int, seed: int, *, part_ranks: int = 0,
                     exact_longest: bool = False) -> dict:
    from dcp_megatron.planner.bounds import exact_alone_time
    from dcp_megatron.planner.milp_reference import family_bound
    from dcp_megatron.planner.policies import make_plan

    batches = batches_of(name, tokens_per_step, steps, seed)
    max_seq_len = max(b.max_length for b in batches)
    ratios, family, longest, fallbacks, plan_ms, exact = [], [], [], 0, [], []
    for batch in batches:
        started = time.perf_counter()
        plan = make_plan("dcp", batch.sequences, cost, max_seq_len=max_seq_len, part_ranks=part_ranks)
        plan_ms.append(1e3 * (time.perf_counter() - started))
        ratios.append(plan.est_step_time_s / plan.lower_bound_s)
        if exact_longest:
            exact.append(plan.est_step_time_s / max(plan.lower_bound_s, exact_alone_time(batch.max_length, cost)))
        family.append(plan.est_step_time_s / family_bound([length for _, length in batch.sequences], cost))
        longest.append(batch.max_length)
        fallbacks += "fallback" in plan.extra
    out = dict(summary(ratios), fallbacks=fallbacks, plan_ms_p50=float(np.median(plan_ms)), bins={},
               vs_family=summary(family), vs_exact_longest=summary(exact) if exact else None)
    longest = np.asarray(longest)
    for lo, hi, label in zip(BIN_EDGES, BIN_EDGES[1:], BIN_NAMES):
        inside = [r for r, L in zip(ratios, longest) if lo <= L < hi]
        if inside:
            out["bins"][label] = summary(inside)
    return out


def measure_milp(args) -> list[dict]:
    from dcp_megatron.planner.bounds import lower_bound
    from dcp_megatron.planner.costmodel import CostModel, MENU_NAMES, cluster_preset, model_preset
    from dcp_megatron.planner.milp_reference import solve_family
    from dcp_megatron.planner.policies import make_plan

    cost = CostModel(model_preset(args.model), cluster_preset(args.cluster, domain_size=args.milp_gpus),
                     allowed_recompute=MENU_NAMES)
    rows = []
    for batch in batches_of("bytescale", args.tokens_per_step, args.milp_instances, args.seed):
        scaled = [(sid, max(1, int(round(length * args.milp_scale)))) for sid, length in batch.sequences]
        lengths = [length for _, length in scaled]
        bound = lower_bound(scaled, cost)
        plan = make_plan("dcp", scaled, cost, max_seq_len=max(lengths))
        milp = solve_family(lengths, cost, time_limit_s=args.milp_time_limit)
        rows.append({"step": batch.step, "longest": max(lengths), "docs": len(lengths), "long_docs": milp.num_long,
                     "bound_s": bound, "milp_s": milp.value_s, "milp_dual_s": milp.dual_bound_s,
                     "milp_optimal": milp.optimal, "milp_solve_s": milp.solve_s, "dcp_s": plan.est_step_time_s,
                     "dcp_fallback": plan.extra.get("fallback")})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated built-in distributions")
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--cluster", default="h200")
    p.add_argument("--gpus", type=int, default=64, help="DCP domain size")
    p.add_argument("--tokens-per-step", type=int, default=16_777_216)
    p.add_argument("--steps", type=int, default=100, help="steps per workload")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--milp-instances", type=int, default=6, help="reduced bytescale instances (0: none)")
    p.add_argument("--milp-gpus", type=int, default=16)
    p.add_argument("--milp-scale", type=float, default=0.25, help="length scale of the reduced instances")
    p.add_argument("--milp-time-limit", type=float, default=20.0, help="seconds per MILP solve")
    p.add_argument("--exact-longest", action="store_true",
                   help="also dcp over max(bound, the longest document's exact alone time); ~0.6 s a step at 16384")
    p.add_argument("--part-ranks", type=int, default=0, metavar="N", help="plan as --dcp-plan-part-ranks N does")
    p.add_argument("--json", default=None, metavar="OUT")
    args = p.parse_args(argv)
    if args.part_ranks < 0:
        p.error(f"--part-ranks must be >= 0, got {args.part_ranks}")
    from dcp_megatron.planner.distributions import BUILTIN_NAMES
    from dcp_megatron.planner.milp_reference import highspy_available

    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in workloads if w not in BUILTIN_NAMES]
    if bad or not workloads:
        p.error(f"--workloads: unknown or empty {bad}; choose from {', '.join(BUILTIN_NAMES)}")
    for name in ("gpus", "tokens_per_step", "steps", "milp_gpus"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.milp_instances < 0 or not 0 < args.milp_scale <= 1 or not args.milp_time_limit > 0:
        p.error("--milp-instances must be >= 0, --milp-scale in (0, 1], --milp-time-limit > 0")

    from dcp_megatron.planner.costmodel import CostModel, MENU_NAMES, cluster_preset, model_preset

    cost = CostModel(model_preset(args.model), cluster_preset(args.cluster, domain_size=args.gpus),
                     allowed_recompute=MENU_NAMES)   # the whole relief menu (relief.py)
    report = {"config": {k: v for k, v in vars(args).items() if k != "json"}, "workloads": {}, "milp": None}
    print(f"dcp / lower bound, {args.model} on {args.gpus} {args.cluster}, {args.tokens_per_step} tokens per step")
    print("  (fam_p95: dcp / the best any plan on aligned power-of-two groups with one long document per")
    print("   micro-batch can do, the MILP family's LP bound; the lower bound also allows other group sizes)")
    print(f"{'workload':<12}{'steps':>6}{'p50':>8}{'p95':>8}{'max':>8}{'fam_p95':>9}{'fallbk':>7}{'plan_ms':>9}")
    for name in workloads:
        r = report["workloads"][name] = measure_workload(name, cost, args.tokens_per_step, args.steps, args.seed,
                                                         part_ranks=args.part_ranks, exact_longest=args.exact_longest)
        print(f"{name:<12}{r['steps']:>6}{r['p50']:>8.3f}{r['p95']:>8.3f}{r['max']:>8.3f}{r['vs_family']['p95']:>9.4f}{r['fallbacks']:>7}"
              f"{r['plan_ms_p50']:>9.1f}")
        if r["vs_exact_longest"]:
            e = r["vs_exact_longest"]
            print(f"  vs max(bound, exact longest alone): p50 {e['p50']:.4f} p95 {e['p95']:.4f} max {e['max']:.4f}")
        if name == "bytescale" or len(r["bins"]) > 1:
            for label, b in r["bins"].items():
                print(f"  longest {label:<10}{b['steps']:>4}{b['p50']:>8.3f}{b['p95']:>8.3f}{b['max']:>8.3f}")
    if args.milp_instances and not highspy_available():
        print("MILP comparison skipped: highspy is not installed (pip install highspy)")
    elif args.milp_instances:
        rows = report["milp"] = measure_milp(args)
        print(f"reduced bytescale instances: {args.milp_gpus} ranks, lengths x {args.milp_scale} "
              f"(MILP: one long document per micro-batch, aligned power-of-two groups, filler divisible)")
        print(f"{'step':>5}{'longest':>9}{'long':>6}{'bound_s':>9}{'milp/lb':>9}{'dual/lb':>9}{'dcp/lb':>8}"
              f"{'dcp/milp':>9}{'opt':>5}{'solve_s':>8}")
        for r in rows:
            lb = r["bound_s"]
            print(f"{r['step']:>5}{r['longest']:>9}{r['long_docs']:>6}{lb:>9.3f}{r['milp_s'] / lb:>9.4f}"
                  f"{r['milp_dual_s'] / lb:>9.4f}{r['dcp_s'] / lb:>8.4f}{r['dcp_s'] / r['milp_s']:>9.4f}"
                  f"{'yes' if r['milp_optimal'] else 'no':>5}{r['milp_solve_s']:>8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
