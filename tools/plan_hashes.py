#!/usr/bin/env python3
"""Hashes of dcp's and megatron-dynamic's plans over a fixed grid, to show a planner speed-up is exact.

    OMP_NUM_THREADS=1 tools/plan_hashes.py > before.txt   # on the old tree, then on the new one; diff the two

Grid: D = 32, 128, 512 x the Wikipedia-, ProLong-, lognormal- and ByteScale-like mixes x PP 1 and 4, three
batches each (tokens per step 4K per GPU), and D = 1,024 x the four mixes at PP 1 (4M tokens, three batches);
llama3-8b on h200, the whole relief menu (as tools/bench_planner.py). One line per plan: the setting, the
SHA-256 of the plan's JSON (`StepPlan.dumps`) and its step time (repr, every bit).
"""
import argparse
import hashlib
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dcp_megatron.planner.batcher import GlobalBatcher  # noqa: E402
from dcp_megatron.planner.costmodel import CostModel, MENU_NAMES, cluster_preset, model_preset  # noqa: E402
from dcp_megatron.planner.distributions import iter_builtin_lengths  # noqa: E402
from dcp_megatron.planner.policies import make_plan  # noqa: E402

MIXES = ("wikipedia", "prolong", "lognormal", "bytescale")


def grid(quick: bool):
    for gpus in (32, 128, 512):
        for mix in MIXES:
            for pp in (1, 4):
                yield gpus, mix, pp
    if not quick:
        for mix in MIXES:
            yield 1024, mix, 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="leave out D = 1,024")
    parser.add_argument("--policies", default="dcp,megatron-dynamic")
    args = parser.parse_args(argv)
    for gpus, mix, pp in grid(args.quick):
        cost = CostModel(model_preset("llama3-8b", pp=pp), cluster_preset("h200", domain_size=gpus),
                         allowed_recompute=MENU_NAMES)
        tokens = 4096 * gpus
        batcher = GlobalBatcher(tokens_per_step=tokens, max_seq_len=tokens, overlong="split")
        batches = list(itertools.islice(batcher.batches(enumerate(iter_builtin_lengths(mix, 0))), args.batches))
        cap = max(b.max_length for b in batches)
        for policy in args.policies.split(","):
            for n, batch in enumerate(batches):
                plan = make_plan(policy, batch.sequences, cost, max_seq_len=cap)
                digest = hashlib.sha256(plan.dumps().encode()).hexdigest()[:16]
                print(f"{policy} D={gpus} {mix} pp={pp} batch={n} {digest} {plan.est_step_time_s!r}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
