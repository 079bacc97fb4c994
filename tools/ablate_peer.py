#!/usr/bin/env python3
"""Where dcp's gain over Megatron dev's dynamic CP (`megatron-dynamic`) comes from, by the cost model.

  PYTHONPATH=. .venv/bin/python tools/ablate_peer.py [--steps 8] [--lengths builtin:wikipedia,builtin:prolong]
                                                     [--model llama3-70b --tp 8]

On the simulator's batches (Llama-3-8B, H200 preset, 4M tokens per step), for a power-of-two domain
(32 ranks) and a non-power-of-two one (24), the mean modelled step time of:
  static               Megatron's one layout
  md                   megatron-dynamic: per-rank token cap = the static layout's capacity
                       (what a user of --max-seqlen-per-dp-cp-rank would set), one global recompute
  md+mem               the same scheduler with the cap dcp's memory model allows with full recompute
                       (memory-aware sizing given to the peer; its one recompute setting then is full)
  dcp-norc             dcp planning without any recompute (CP sizes must then hold every micro-batch)
  dcp                  ours (per-micro-batch CP size and recompute, any group size, memory-aware)
Modelled, not measured. Each column is a speed-up over static (higher is better).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dcp_megatron.planner.cluster import cluster_preset  # noqa: E402
from dcp_megatron.planner.cost import CostModel  # noqa: E402
from dcp_megatron.planner.model import model_preset  # noqa: E402
from dcp_megatron.planner.plan import StepPlan  # noqa: E402
from dcp_megatron.planner.policies import make_plan  # noqa: E402
from dcp_megatron.planner.policies.common import check_batch  # noqa: E402
from dcp_megatron.planner.policies.megatron_dynamic import plan_megatron_dynamic  # noqa: E402
from dcp_megatron.planner.timeline import plan_makespan  # noqa: E402
from dcp_megatron.simulate import SimulationConfig, cut_batches  # noqa: E402

COLUMNS = ("static", "md", "md+mem", "dcp-norc", "dcp")


def step_times(batch, cost, max_seq_len: int) -> dict[str, float]:
    ids, lengths = check_batch(batch)
    out = {name: make_plan(policy, batch, cost, max_seq_len=max_seq_len).est_step_time_s
           for name, policy in (("static", "static"), ("md", "megatron-dynamic"), ("dcp", "dcp"))}
    cap = cost.max_local_tokens(cost.strongest_recompute)
    waves = plan_megatron_dynamic(ids, lengths, cost, max_seq_len=max_seq_len, token_cap=cap)
    out["md+mem"] = plan_makespan(StepPlan(domain_size=cost.cluster.domain_size, waves=waves))
    no_recompute = CostModel(cost.model, cost.cluster, allowed_recompute=("none",))
    try:
        out["dcp-norc"] = make_plan("dcp", batch, no_recompute, max_seq_len=max_seq_len).est_step_time_s
    except ValueError:               # a document fits no group without recompute
        out["dcp-norc"] = float("inf")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="builtin:wikipedia,builtin:prolong")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--domains", default="32,24", help="DP x CP domain sizes (GPUs = domain * tp)")
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args(argv)
    print(f"{args.model}, tp {args.tp}, H200 preset (modelled)")
    print("| lengths | domain | " + " | ".join(COLUMNS) + " | dcp / md |")
    print("|---|---|" + "---|" * (len(COLUMNS) + 1))
    for lengths in args.lengths.split(","):
        for domain in (int(d) for d in args.domains.split(",")):
            config = SimulationConfig(lengths=lengths, gpus=domain * args.tp, steps=args.steps, model=args.model,
                                      tp=args.tp)
            cost = CostModel(model_preset(config.model, tp=args.tp),
                             cluster_preset(config.cluster, domain_size=domain, gpus_per_node=config.domain_ranks_per_node))
            batches, max_seq_len = cut_batches(config)
            totals = dict.fromkeys(COLUMNS, 0.0)
            for batch in batches:
                for name, t in step_times(batch.sequences, cost, max_seq_len).items():
                    totals[name] += t
            cells = " | ".join(f"{totals['static'] / totals[c]:.2f}x" for c in COLUMNS)
            print(f"| {lengths} | {domain} | {cells} | {totals['md'] / totals['dcp']:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
