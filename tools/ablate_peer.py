#!/usr/bin/env python3
"""Where dcp's gain over Megatron dev's dynamic CP (`megatron-dynamic`) comes from, by the cost model.

  PYTHONPATH=. .venv/bin/python tools/ablate_peer.py [--steps 8] [--lengths builtin:wikipedia,builtin:prolong]
                                                     [--domains 32,24] [--model llama3-70b --tp 8]

On the simulator's batches (H200 preset, --tokens-per-step per step), per domain, the mean modelled step of:
  static       Megatron's one layout, tuned: the (CP size, recompute) with the lowest mean step over the batches
  md           megatron-dynamic untuned: recompute off, per-rank token cap = the most memory holds without it
  md-tuned     megatron-dynamic tuned: (token cap, smallest CP size, recompute) swept over the same batches
               (planner/baselines/sweep.py; the winner is printed)
  dcp-norc     dcp planning without any recompute (CP sizes must then hold every micro-batch)
  md-old       megatron-dynamic tuned on the old menu (none, core-attention recompute, full k: no MLP recompute)
  dcp-old      dcp on the old menu: per-micro-batch relief without module recompute or offload
  dcp-runwide  dcp with md-tuned's run-wide relief as its only relief besides full layers (module relief per
               micro-batch vs run-wide)
  dcp-pow2     dcp without non-power-of-two groups (dcp/odd_groups.py's alternative off)
  dcp-minsize  dcp sizing each document at the smallest CP size that holds it (the cost model's growth rules off:
               `SizedSequences.grow_cheaper`, `grow_long_sequences`)
  dcp-lockstep dcp with equal micro-batch counts on every rank (one micro-batch per group per wave, as under
               EP > 1 or ZeRO-3) instead of counts per rank
  dcp          ours, untuned (per-micro-batch CP size and relief from the whole menu, any group size)
Modelled, not measured. Each column is a speed-up over the tuned static (higher is better); the last column is
dcp over the tuned megatron-dynamic.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dcp_megatron.planner.baselines.sweep import sweep  # noqa: E402
from dcp_megatron.planner.costmodel import CostModel, MENU_NAMES, cluster_preset, model_preset  # noqa: E402
pass  # noqa: E402
pass  # noqa: E402
pass  # noqa: E402
from dcp_megatron.planner.policies import make_plan  # noqa: E402
from dcp_megatron.simulate import SimulationConfig, cut_batches  # noqa: E402

COLUMNS = ("static", "md", "md-old", "md-tuned", "dcp-norc", "dcp-old", "dcp-runwide", "dcp-pow2", "dcp-minsize",
           "dcp-lockstep", "dcp")


def _lever_off(column: str):
    """A context with one of dcp's levers switched off (the ablation's own switch: the planner has no such
    options, each lever is always on)."""
    from dcp_megatron.planner.costmodel import ModelShape
    from dcp_megatron.planner.dcp import own_layout as dcp
    from dcp_megatron.planner.dcp.sized_sequences import SizedSequences
    if column == "dcp-pow2":
        return mock.patch.object(dcp, "odd_group_alternative", lambda ids, lengths, cost, seqs, makespan, groups,
                                 list_schedule: groups)
    if column == "dcp-minsize":
        stack = contextlib.ExitStack()
        stack.enter_context(mock.patch.object(SizedSequences, "grow_cheaper", lambda self, allowed_top: False))
        stack.enter_context(mock.patch.object(SizedSequences, "grow_long_sequences",
                                              lambda self, domain_size, allowed_top: None))
        return stack
    if column == "dcp-lockstep":
        return mock.patch.object(ModelShape, "lockstep", new_callable=mock.PropertyMock, return_value=True)
    return contextlib.nullcontext()
LEGACY = ("none", "selective", "full")


def mean_steps(batches, cost, max_seq_len: int) -> tuple[dict[str, float], dict[str, str]]:
    seqs = [b.sequences for b in batches]
    tuned = {name: sweep(name, seqs, cost, max_seq_len=max_seq_len) for name in ("static", "megatron-dynamic")}
    out = {"static": tuned["static"].winner_mean_step_s, "md-tuned": tuned["megatron-dynamic"].winner_mean_step_s}
    no_recompute = CostModel(cost.model, cost.cluster, allowed_recompute=("none",))
    old = CostModel(cost.model, cost.cluster, allowed_recompute=LEGACY)
    out["md-old"] = sweep("megatron-dynamic", seqs, old, max_seq_len=max_seq_len).winner_mean_step_s
    winner = tuned["megatron-dynamic"].winner.recompute
    runwide = CostModel(cost.model, cost.cluster, allowed_recompute=tuple(
        {"none", "full"} | set(winner.modules) | ({"offload"} if winner.offload else set())))
    for name, policy, model in (("md", "megatron-dynamic", cost), ("dcp", "dcp", cost), ("dcp-norc", "dcp", no_recompute),
                                ("dcp-old", "dcp", old), ("dcp-runwide", "dcp", runwide), ("dcp-pow2", "dcp", cost),
                                ("dcp-minsize", "dcp", cost), ("dcp-lockstep", "dcp", cost)):
        try:
            with _lever_off(name):
                out[name] = sum(make_plan(policy, s, model, max_seq_len=max_seq_len).est_step_time_s
                                for s in seqs) / len(seqs)
        except ValueError:           # a document fits no group without recompute
            out[name] = float("inf")
    return out, {"static": str(tuned["static"].winner), "md-tuned": str(tuned["megatron-dynamic"].winner)}


def _run_inputs(lengths: str, domain: int, args):
    """(lengths, domain, cost model, batches, max_seq_len) of one row; ValueError in one line for bad input."""
    config = SimulationConfig(lengths=lengths, gpus=domain * args.tp, steps=args.steps, model=args.model,
                              tp=args.tp, tokens_per_step=args.tokens_per_step)
    cost = CostModel(model_preset(config.model, tp=args.tp),
                     cluster_preset(config.cluster, domain_size=domain, gpus_per_node=config.domain_ranks_per_node),
                     allowed_recompute=MENU_NAMES)
    batches, max_seq_len = cut_batches(config)
    return lengths, domain, cost, batches, max_seq_len


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="builtin:wikipedia,builtin:prolong")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--domains", default="32,24", help="DP x CP domain sizes (GPUs = domain * tp)")
    parser.add_argument("--tokens-per-step", type=int, default=4_194_304)
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args(argv)
    try:   # every input checked before the long sweeps, by dcp-simulate's own checks (SimulationConfig, cut_batches)
        runs = [_run_inputs(lengths, int(domain), args) for lengths in args.lengths.split(",")
                for domain in args.domains.split(",")]
    except ValueError as err:
        print(f"ablate_peer: error: {err}", file=sys.stderr)
        return 2
    print(f"{args.model}, tp {args.tp}, H200 preset, {args.tokens_per_step} tokens per step, {args.steps} steps (modelled)")
    print("| lengths | domain | " + " | ".join(COLUMNS) + " | dcp / md-tuned | tuned settings (static; md) |")
    print("|---|---|" + "---|" * (len(COLUMNS) + 2))
    for lengths, domain, cost, batches, max_seq_len in runs:
        try:
            means, settings = mean_steps(batches, cost, max_seq_len)
        except ValueError as err:    # a baseline no setting of its grid can run (e.g. static's sweep)
            print(f"ablate_peer: error: {lengths}, domain {domain}: {err}", file=sys.stderr)
            return 2
        cells = " | ".join(f"{means['static'] / means[c]:.3f}x" for c in COLUMNS)
        print(f"| {lengths} | {domain} | {cells} | {means['md-tuned'] / means['dcp']:.3f}x | "
              f"{settings['static']}; {settings['md-tuned']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
