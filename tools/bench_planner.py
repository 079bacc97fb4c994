#!/usr/bin/env python3
"""Plan latency of a policy at scale: prints wall and CPU time per plan, p50 and p99 (numbers only).

Default setting (the planner's latency target at scale): D=1024 ranks (planned whole, as a run does below 8,192
ranks; from 8,192 on a run splits the planning and so does this benchmark: --part-ranks), 4,194,304-token batches
cut in order from the built-in Wikipedia-like distribution, llama3-8b on h200, the dcp policy, 20 batches. The
length cap is the longest document of those batches (as dcp-simulate chooses it). One
untimed warm-up plan on the first batch comes first (first-call costs are not plan costs).
Single-threaded numpy is advised for a one-core figure: OMP_NUM_THREADS=1. Wall time
(plan_ms_*) counts time the process waited for a core; on a shared machine the CPU time of
the process (cpu_ms_*, time.process_time) is the steadier figure of the planner's own cost.

Planning off the critical path (`dcp_megatron/planner/ahead.py`): the batches are then replayed as a
run would: step k+1 is planned on the worker thread while step k "trains" for the time its own plan
estimates (`est_step_time_s`; a sleep, which like GPU training leaves the interpreter free), and
exposed_ms_* is how long each step waited for its plan. The first step has nothing to hide behind
and is left out of the exposed figures (it is planned before training starts).
"""
import argparse
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from dcp_megatron.planner.batcher import GlobalBatcher  # noqa: E402
from dcp_megatron.planner.costmodel import cluster_preset, model_preset  # noqa: E402
from dcp_megatron.planner.distributions import iter_builtin_lengths  # noqa: E402
pass  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=1024, help="DCP domain size D")
    parser.add_argument("--tokens-per-step", type=int, default=4_194_304)
    parser.add_argument("--distribution", default="wikipedia")
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--cluster", default="h200")
    parser.add_argument("--policy", default="dcp")
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--part-ranks", type=int, default=None, metavar="N",
                        help="split planning (--dcp-plan-part-ranks N): time one rank's share, the slowest part's "
                             "rank (its part, the others' bytes decoded, the plan composed; the gather itself is "
                             "not timed), and print the split plan's step against the whole plan's. Default: what "
                             "a run does on this domain (parts of 1024 from 8192 ranks on); 0: whole plans")
    parser.add_argument("--json", default=None, metavar="OUT")
    args = parser.parse_args(argv)
    if args.batches < 2:
        parser.error(f"--batches must be at least 2 (planning ahead needs a next step), got {args.batches}")
    if args.part_ranks is None:
        from dcp_megatron.config import default_part_ranks
        args.part_ranks = default_part_ranks(args.gpus) if args.policy == "dcp" else 0
    if args.part_ranks < 0 or (args.part_ranks and args.policy != "dcp"):
        parser.error(f"--part-ranks must be >= 0, and is for --policy dcp, got {args.part_ranks} ({args.policy})")

    from dcp_megatron.planner.costmodel import CostModel, MENU_NAMES
    from dcp_megatron.planner.policies import make_plan

    cost = CostModel(model_preset(args.model), cluster_preset(args.cluster, domain_size=args.gpus),
                     allowed_recompute=MENU_NAMES)   # the whole relief menu (relief.py)
    batcher = GlobalBatcher(tokens_per_step=args.tokens_per_step, max_seq_len=args.tokens_per_step, overlong="split")
    docs = enumerate(iter_builtin_lengths(args.distribution, args.seed))
    batches = list(itertools.islice(batcher.batches(docs), args.batches))
    max_seq_len = max(b.max_length for b in batches)

    if args.part_ranks:
        plan_functions, split_gain = split_plan_functions(batches, cost, max_seq_len, args.part_ranks)
    else:
        def whole(sequences):
            return make_plan(args.policy, sequences, cost, max_seq_len=max_seq_len)
        plan_functions, split_gain = [whole] * len(batches), []
    plan_functions[0](batches[0].sequences)   # warm-up
    plan_ms, cpu_ms = [], []
    for batch, plan_function in zip(batches, plan_functions):
        started, cpu_started = time.perf_counter(), time.process_time()
        plan_function(batch.sequences)
        plan_ms.append(1e3 * (time.perf_counter() - started))
        cpu_ms.append(1e3 * (time.process_time() - cpu_started))
    exposed_ms, overlapped_plan_ms, step_ms = overlapped_run(plan_functions, batches)
    series = [("plan_ms", plan_ms), ("cpu_ms", cpu_ms), ("exposed_ms", exposed_ms),
              ("overlapped_plan_ms", overlapped_plan_ms), ("step_ms", step_ms)]
    if split_gain:
        series.append(("split_over_whole_step", split_gain))
    result = {f"{name}_p{q}": float(np.percentile(values, q)) for name, values in series for q in (50, 99)}
    for key, value in result.items():
        print(f"{key} {value:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(result, policy=args.policy, domain_size=args.gpus, batches=args.batches,
                           part_ranks=args.part_ranks,
                           tokens_per_step=args.tokens_per_step, distribution=args.distribution), f, indent=2)
            f.write("\n")
    return 0


def split_plan_functions(batches, cost, max_seq_len, part_ranks):
    """Per batch, the plan function of its slowest part's rank (core/split_planning.SplitPlanner with the other
    parts' bytes handed in as the gather would return them), and split / whole step per batch."""
    from dcp_megatron.core.split_planning import SplitPlanner
    from dcp_megatron.planner.dcp.search import plan_part
    from dcp_megatron.planner.dcp.split import assign_shares, split_parts
    from dcp_megatron.planner.plan_bytes import plan_to_bytes
    from dcp_megatron.planner.policies import checked_inputs, make_plan

    functions, gains = [], []
    for batch in batches:
        whole = make_plan("dcp", batch.sequences, cost, max_seq_len=max_seq_len)
        split = make_plan("dcp", batch.sequences, cost, max_seq_len=max_seq_len, part_ranks=part_ranks)
        gains.append(split.est_step_time_s / whole.est_step_time_s)
        ids, lengths, _, _, bound = checked_inputs("dcp", batch.sequences, cost, max_seq_len=max_seq_len)
        size = split_parts(lengths, cost, part_ranks, bound)
        if not size:                 # planned whole on every rank
            functions.append(lambda sequences: make_plan("dcp", sequences, cost, max_seq_len=max_seq_len,
                                                         part_ranks=part_ranks))
            continue
        part_of = assign_shares(ids, lengths, cost, cost.cluster.domain_size // size)
        seconds, encoded = [], []
        for p in range(cost.cluster.domain_size // size):
            started = time.process_time()
            encoded.append(plan_to_bytes(plan_part(ids, lengths, cost, part_of, p, max_seq_len=max_seq_len,
                                                   part_ranks=size, bound=bound)))
            seconds.append(time.process_time() - started)
        slowest = int(np.argmax(seconds))
        planner = SplitPlanner(policy="dcp", max_seq_len=max_seq_len, part_ranks=part_ranks,
                               domain_rank=slowest * size, group=None,
                               gather=lambda mine, *, part_ranks, num_parts, encoded=encoded: list(encoded))
        functions.append(lambda sequences, planner=planner: planner(sequences, cost))
    return functions, gains


def overlapped_run(plan_functions, batches):
    """Exposed planning per step when step k+1 is planned while step k trains for its estimated time."""
    from dcp_megatron.planner.ahead import PlanAhead, plan_synchronously

    ahead = PlanAhead(lambda k, sequences: plan_functions[k](sequences))
    try:
        current = plan_synchronously(0, lambda: plan_functions[0](batches[0].sequences))
        exposed_ms, plan_ms, step_ms = [], [], []
        for k in range(len(batches)):
            if k + 1 < len(batches):
                ahead.submit(k + 1, k + 1, batches[k + 1].sequences)
            step_s = current.plan.est_step_time_s
            time.sleep(step_s)                           # step k trains
            step_ms.append(1e3 * step_s)
            if k + 1 < len(batches):
                current = ahead.result(k + 1)
                exposed_ms.append(1e3 * current.exposed_s)
                plan_ms.append(1e3 * current.plan_s)
    finally:
        ahead.close()
    return exposed_ms, plan_ms, step_ms


if __name__ == "__main__":
    sys.exit(main())
