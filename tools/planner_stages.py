#!/usr/bin/env python3
"""Where a dcp plan's CPU time goes, per stage (CPU seconds per plan, no profiler overhead).

    OMP_NUM_THREADS=1 tools/planner_stages.py --gpus 8192 --tokens-per-step 33554432 [--distribution bytescale]

The same setting as tools/bench_planner.py (llama3-8b on h200, the whole relief menu, batches cut in order from a
built-in distribution, one untimed warm-up plan). Each stage's function is wrapped with a CPU-time counter, so a
stage's figure includes the stages nested in it (indented in the output): the lower bound, dcp's own layout, each
baseline layout dcp seeds from (megatron-dynamic's scheduler inside its layout), the static packing they share,
the relief pass over each seed, and plan building (attention flavours and the timeline) of every candidate.
"""
import argparse
import itertools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dcp_megatron.planner import policies  # noqa: E402
from dcp_megatron.planner.baselines import BASELINES  # noqa: E402
from dcp_megatron.planner.baselines import megatron_dynamic  # noqa: E402
from dcp_megatron.planner.batcher import GlobalBatcher  # noqa: E402
from dcp_megatron.planner.costmodel import CostModel, MENU_NAMES, cluster_preset, model_preset  # noqa: E402
pass  # noqa: E402
from dcp_megatron.planner.dcp import own_layout, search  # noqa: E402
from dcp_megatron.planner.distributions import iter_builtin_lengths  # noqa: E402
pass  # noqa: E402
pass  # noqa: E402

# (label, module, attribute, depth): the functions timed, as the planner calls them
STAGES = [
    ("lower bound", policies, "lower_bound_of_lengths", 0),
    ("dcp own layout", search, "plan_dcp", 0),
    ("odd-group alternative", own_layout, "odd_group_alternative", 1),
    ("static packing (shared by the static seeds)", search, "static_packing", 0),
    ("relief pass over the seeds", search, "with_own_reliefs", 0),
    ("plan building (flavours, timeline), every candidate", search, "finish_plan", 0),
    ("megatron-dynamic: scheduler", megatron_dynamic, "dynamic_schedule", 1),
    ("megatron-dynamic: waves and estimates", megatron_dynamic, "waves_of_schedule", 1),
]


def timed(function, totals: dict, label: str):
    def wrapper(*args, **kwargs):
        started = time.process_time()
        try:
            return function(*args, **kwargs)
        finally:
            totals[label] = totals.get(label, 0.0) + time.process_time() - started
    return wrapper


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=1024)
    parser.add_argument("--tokens-per-step", type=int, default=4_194_304)
    parser.add_argument("--distribution", default="wikipedia")
    parser.add_argument("--batches", type=int, default=3)
    args = parser.parse_args(argv)
    cost = CostModel(model_preset("llama3-8b"), cluster_preset("h200", domain_size=args.gpus),
                     allowed_recompute=MENU_NAMES)
    batcher = GlobalBatcher(tokens_per_step=args.tokens_per_step, max_seq_len=args.tokens_per_step, overlong="split")
    batches = list(itertools.islice(batcher.batches(enumerate(iter_builtin_lengths(args.distribution, 0))),
                                    args.batches + 1))
    max_seq_len = max(b.max_length for b in batches)
    policies.make_plan("dcp", batches[0].sequences, cost, max_seq_len=max_seq_len)   # warm-up
    totals: dict[str, float] = {}
    originals = [(module, name, getattr(module, name)) for _, module, name, _ in STAGES]
    baselines = dict(BASELINES)
    try:                                  # the counters are removed again (the tool is also run in tests)
        for label, module, name, _ in STAGES:
            setattr(module, name, timed(getattr(module, name), totals, label))
        for name in list(BASELINES):
            BASELINES[name] = timed(BASELINES[name], totals, f"baseline layout: {name}")
        started = time.process_time()
        for batch in batches[1:]:
            policies.make_plan("dcp", batch.sequences, cost, max_seq_len=max_seq_len)
        whole = (time.process_time() - started) / args.batches
    finally:
        for module, name, function in originals:
            setattr(module, name, function)
        BASELINES.update(baselines)
    print(f"D={args.gpus} tokens={args.tokens_per_step} {args.distribution}: "
          f"{len(batches[1].sequences)} sequences in the first timed batch; CPU s per plan {whole:.3f}")
    order = [(label, depth) for label, _, _, depth in STAGES[:6]] + [(f"baseline layout: {n}", 0) for n in BASELINES]
    order += [(label, depth) for label, _, _, depth in STAGES[6:]]
    for label, depth in order:
        seconds = totals.get(label, 0.0) / args.batches
        print(f"{'  ' * depth}{label:<{52 - 2 * depth}} {seconds:8.3f} s {100 * seconds / whole:5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
