#!/usr/bin/env python3
"""What tuning Megatron dev's dynamic CP is worth, and what `--dcp` saves a user: dev's scheduler
(`megatron-dynamic`) at the settings a user tries first vs its tuned setting vs dcp with no tuning.

  PYTHONPATH=. .venv/bin/python tools/peer_robustness.py --lengths builtin:bytescale --gpus 64 \\
      --tokens-per-step 16777216 --steps 8

Rows (each one run-wide setting for the whole run, on the simulator's batches; modelled, not measured):
  default              recompute off, smallest CP size 1, per-rank token cap = the most tokens memory holds without
                       recompute (the least recompute that holds the run's longest sequence on the whole domain if
                       none does)
  static's capacity    cap = max_seq_len / the static layout's CP size, tuned and untuned (megatron-core's documented
                       starting point for max_seqlen_per_dp_cp_rank: "maximum sequence length / context parallel
                       size"), with the least recompute that fits it
  cap N                the round caps a user tries, each with the least recompute that fits it
  tuned                the sweep's winner (planner/baselines/sweep.py)
and dcp (no settings to tune). Columns: mean step, spread over the steps (min-max), dcp's speed-up over the row.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from dcp_megatron.planner.baselines.sweep import sweep  # noqa: E402
from dcp_megatron.planner.costmodel import CostModel, cluster_preset, model_preset  # noqa: E402
pass  # noqa: E402
pass  # noqa: E402
from dcp_megatron.planner.policies import make_plan  # noqa: E402
from dcp_megatron.planner.baselines.megatron_dynamic import dynamic_cp_sizes  # noqa: E402
from dcp_megatron.planner.baselines.settings import (DynamicSetting, default_dynamic_setting,  # noqa: E402
                                                    least_recompute_for)
from dcp_megatron.planner.baselines.static import static_layout  # noqa: E402
from dcp_megatron.simulate import SimulationConfig, cut_batches  # noqa: E402

USER_CAPS = (8192, 16384, 32768, 65536)


def step_times(policy: str, seqs, cost, max_seq_len: int, setting=None) -> np.ndarray | None:
    try:
        return np.array([make_plan(policy, s, cost, max_seq_len=max_seq_len, setting=setting).est_step_time_s
                         for s in seqs])
    except ValueError:                 # the setting cannot hold a batch
        return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="builtin:bytescale")
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--gpus", type=int, default=64)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--tokens-per-step", type=int, default=16_777_216)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--caps", default=",".join(map(str, USER_CAPS)), help="round per-rank token caps a user tries")
    args = p.parse_args(argv)
    config = SimulationConfig(lengths=args.lengths, model=args.model, gpus=args.gpus, tp=args.tp,
                              tokens_per_step=args.tokens_per_step, steps=args.steps)
    cost = CostModel(model_preset(config.model, tp=args.tp),
                     cluster_preset(config.cluster, domain_size=config.domain_size,
                                    gpus_per_node=config.domain_ranks_per_node))
    batches, max_seq_len = cut_batches(config)
    seqs = [b.sequences for b in batches]
    D = config.domain_size
    static = sweep("static", seqs, cost, max_seq_len=max_seq_len).winner
    capacity = static_layout(cost, max_seq_len, static).capacity_local_tokens
    untuned = static_layout(cost, max_seq_len)
    rows = [("default", default_dynamic_setting(cost, max_seq_len, dynamic_cp_sizes(D, cost.cluster.cp_size_limit))),
            (f"tuned static's capacity (cp {static.cp_size})", capacity),
            (f"untuned static's capacity (cp {untuned.cp_size}; what the simulator used to hand it)",
             untuned.capacity_local_tokens)]
    rows += [(f"cap {cap}", cap) for cap in (int(c) for c in args.caps.split(","))]
    tuned = sweep("megatron-dynamic", seqs, cost, max_seq_len=max_seq_len)
    rows.append(("tuned (sweep winner)", tuned.winner))
    dcp = step_times("dcp", seqs, cost, max_seq_len)
    print(f"{args.lengths}: {len(seqs)} steps of <= {args.tokens_per_step} tokens, max_seq_len {max_seq_len}, "
          f"{args.model} tp {args.tp} on {args.gpus} H200 (domain {D}); modelled")
    print("| megatron-dynamic at | setting | mean step s (min-max) | dcp speed-up |")
    print("|---|---|---|---|")
    for label, setting in rows:
        if isinstance(setting, int):
            recompute = least_recompute_for(cost, setting)
            setting = DynamicSetting(token_cap=setting, recompute=recompute) if recompute else None
        times = step_times("megatron-dynamic", seqs, cost, max_seq_len, setting) if setting else None
        if times is None:
            print(f"| {label} | {setting or '-'} | cannot run (a document fits no CP size, or memory) | - |")
            continue
        print(f"| {label} | {setting} | {times.mean():.3f} ({times.min():.3f}-{times.max():.3f}) | "
              f"{times.sum() / dcp.sum():.3f}x |", flush=True)
    print(f"| dcp (no tuning) | - | {dcp.mean():.3f} ({dcp.min():.3f}-{dcp.max():.3f}) | 1.000x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
