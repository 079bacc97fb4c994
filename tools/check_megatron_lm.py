#!/usr/bin/env python3
"""Train Megatron-LM's own, unmodified `pretrain_gpt.py` with and without `--dcp` through our launcher.

  .venv/bin/python tools/check_megatron_lm.py DIR [--iters 4] [--layout dp|tp2sp|pp2|mixtral|mixtral-samples|pp4vpp2|
                                                              deepseek|deepseek-ep2|deepseek-mtp|deepseek-mtp-samples]

DIR holds Megatron-LM's top-level `pretrain_gpt.py`, `gpt_builders.py` and `model_provider.py` (tag
core_v0.19.0; public, not shipped here) and no `megatron/` package, so the installed megatron-core 0.19.2
wheel is the one imported. Runs the tiny Llama-3 flag set of tests/support/megatron_runs.py, prints both loss traces
and the DCP plans, and exits 1 unless the traces agree within 1e-5. Layouts: `dp` (2 ranks, both runs),
`tp2sp` (TP 2 + sequence parallelism) and `pp2` (PP 2): plain on 2 ranks, `--dcp` on 4 (a 2-rank domain);
`mixtral` (the MoE flags of Megatron-LM's Mixtral example, 4 experts, EP 2, aux loss 1e-2: 2 ranks, both runs;
under --dcp the aux loss is per document, Megatron's per sample, and with --dataloader-inter-document-masking a
sample holds several documents: the traces may differ by the aux term's share), `mixtral-samples` (the same
without inter-document masking: a document is a sample, and the traces agree), `pp4vpp2` (PP 4 with two virtual
stages per rank: plain on 4 ranks, --dcp on 8, a 2-rank domain per stage; the plain run is our script's, see
_PLAIN_WITH_OUR_SCRIPT), `deepseek` (DeepSeek-V3's layers at tiny size, tests/support/megatron_runs.DEEPSEEK_FLAGS:
MLA, a dense first layer, 4 experts with sigmoid scores, expert bias, group-limited top-k and a shared expert; EP 1
on 2 ranks, both runs) and `deepseek-ep2` (the same at EP 2 on 4 ranks, a 4-rank domain under --dcp). Their
seq_aux_loss is per document under --dcp and per sample in the plain run (coefficient 1e-4: below the printed
loss digits). `deepseek-mtp` adds one multi-token-prediction layer (loss weight 0.1) and compares the logged
`mtp_1 loss` too (per document under --dcp, per sample in the plain run); `deepseek-mtp-samples` is the same
without --dataloader-inter-document-masking (a document is a sample: the same objective).
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.support.megatron_runs import (DEEPSEEK_FLAGS, DEEPSEEK_TINY, LLAMA_TINY, OUR_SCRIPT,  # noqa: E402
                                         run_training)

# Layouts whose plain run uses our pretrain_scripts/pretrain_gpt.py (the same model from the same flags): at
# core_v0.19.0 Megatron-LM's own script cannot run them without --dcp. Its `is_dataset_built_on_rank` builds no
# dataset on middle pipeline stages (or middle virtual-stage chunks) unless the run is SFT, while its `get_batch`
# reads a batch on every stage once documents are packed (--dataloader-inter-document-masking): `next(None)`.
# Under --dcp the global batch is read on the first stage only and every stage gets its micro-batches from DCP.
_PLAIN_WITH_OUR_SCRIPT = {"pp4vpp2"}


# Megatron-LM's examples/mixtral/train_mixtral_8x7b_distributed.sh (core_v0.19.0), its model and MoE flags at tiny
# size (8 -> 4 experts, EP 8 -> 2; --moe-grouped-gemm left out: the local spec's grouped GEMM needs a GPU kernel).
_MIXTRAL = ("--init-method-std 0.01 --no-position-embedding --rotary-base 1000000 --num-experts 4 --moe-router-topk 2 "
            "--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 --moe-token-dispatcher-type alltoall "
            "--expert-model-parallel-size 2 --overlap-grad-reduce --overlap-param-gather").split()
# PP 4 with two virtual stages per rank (8 layers, one per virtual stage): a 2-rank domain per stage on 8 ranks.
# --eval-iters 0: Megatron's evaluation is not DCP's (it runs Megatron's own path), and there Megatron-LM's script
# reads a batch on middle stages that have no data iterator (see _PLAIN_WITH_OUR_SCRIPT).
_PP4_VPP2 = ("--pipeline-model-parallel-size 4 --num-layers 8 --num-layers-per-virtual-pipeline-stage 1 "
             "--eval-iters 0").split()

_SAMPLES = tuple(flag for flag in LLAMA_TINY if flag != "--dataloader-inter-document-masking")
_DEEPSEEK = [*DEEPSEEK_FLAGS, "--moe-token-dispatcher-type", "alltoall"]
# DeepSeek-V3's one multi-token-prediction layer (its loss weight 0.1)
_MTP = ["--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.1"]
_DEEPSEEK_SAMPLES = tuple(flag for flag in DEEPSEEK_TINY if flag != "--dataloader-inter-document-masking")
# layouts trained on whole samples (no --dataloader-inter-document-masking): their base flags
_ON_SAMPLES = {"mixtral-samples": _SAMPLES, "deepseek-mtp-samples": _DEEPSEEK_SAMPLES}

# layout: (flags of both runs, --dcp budget flags (real bytes: costmodel/memory_spec.py CPU_FP32; each mixes CP 1 and 2
# in dcp's own plans on the tests' lengths), ranks of the --dcp run, ranks of the plain run)
_LAYOUTS = {
    "dp": ([], ["--dcp-memory-budget-gb", "0.007"], 2, 2),
    "tp2sp": (["--tensor-model-parallel-size", "2", "--sequence-parallel"], ["--dcp-memory-budget-gb", "0.0037"], 4, 2),
    "pp2": (["--pipeline-model-parallel-size", "2"],
            ["--dcp-memory-budget-gb", "0.0065", "--dcp-recompute", "selective,full"], 4, 2),
    "mixtral": (_MIXTRAL, ["--dcp-memory-budget-gb", "0.012"], 2, 2),
    "mixtral-samples": (_MIXTRAL, ["--dcp-memory-budget-gb", "0.04"], 2, 2),
    "pp4vpp2": (_PP4_VPP2, ["--dcp-memory-budget-gb", "0.021", "--dcp-recompute", "selective,full"], 8, 4),
    "deepseek": (_DEEPSEEK, ["--dcp-memory-budget-gb", "0.008"], 2, 2),
    "deepseek-ep2": ([*_DEEPSEEK, "--expert-model-parallel-size", "2"], ["--dcp-memory-budget-gb", "0.008"], 4, 4),
    "deepseek-mtp": ([*_DEEPSEEK, *_MTP], ["--dcp-memory-budget-gb", "0.015"], 2, 2),
    "deepseek-mtp-samples": ([*_DEEPSEEK, *_MTP], ["--dcp-memory-budget-gb", "0.015"], 2, 2),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory")
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--layout", choices=sorted(_LAYOUTS), default="dp")
    args = parser.parse_args(argv)
    script = os.path.join(args.directory, "pretrain_gpt.py")
    for name in ("pretrain_gpt.py", "gpt_builders.py", "model_provider.py"):
        if not os.path.isfile(os.path.join(args.directory, name)):
            print(f"check_megatron_lm: {args.directory} has no {name}", file=sys.stderr)
            return 2
    if os.path.isdir(os.path.join(args.directory, "megatron")):
        print(f"check_megatron_lm: {args.directory} holds a megatron/ package, which would shadow the installed "
              "megatron-core; copy the three scripts to a directory of their own", file=sys.stderr)
        return 2
    runs = {}
    layout, budget, dcp_ranks, plain_ranks = _LAYOUTS[args.layout]
    plain_script = OUR_SCRIPT if args.layout in _PLAIN_WITH_OUR_SCRIPT else script
    for label, run_script, extra, nproc in (("plain", plain_script, layout, plain_ranks),
                                            ("dcp", script, [*layout, "--dcp", *budget], dcp_ranks)):
        base = _ON_SAMPLES.get(args.layout) or (DEEPSEEK_TINY if args.layout.startswith("deepseek") else LLAMA_TINY)
        runs[label] = run = run_training(run_script, extra, nproc=nproc, iters=args.iters, base=base,
                                         timeout_s=1200).check()
        print(f"{label:5s} loss trace: {run.loss_trace()}")
        for name, trace in sorted(run.moe_metrics.items()):
            if name.startswith("mtp_"):
                print(f"{label:5s} {name} trace: {[trace[i] for i in sorted(trace)]}")
    for step, info in sorted(runs["dcp"].dcp_steps.items()):
        print(f"  dcp step {step}: {info['policy']} cp sizes {info['cp_sizes']} micro-batches/rank "
              f"{'/'.join(map(str, info['counts']))} recompute {info['recompute']}")
    worst = _worst(runs["plain"].loss_trace(), runs["dcp"].loss_trace())
    print(f"max relative loss difference: {worst:.2e}")
    for name, plain_trace in sorted(runs["plain"].moe_metrics.items()):
        if name.startswith("mtp_"):
            dcp_trace = runs["dcp"].moe_metrics.get(name, {})
            mtp_worst = _worst([plain_trace[i] for i in sorted(plain_trace)], [dcp_trace[i] for i in sorted(dcp_trace)])
            print(f"max relative {name} difference: {mtp_worst:.2e}")
            worst = max(worst, mtp_worst)
    return 0 if worst <= 1e-5 else 1


def _worst(plain: list[float], dcp: list[float]) -> float:
    """The largest relative difference of two traces (inf unless both have the same, non-zero, length)."""
    return max(abs(a - b) / abs(b) for a, b in zip(dcp, plain)) if plain and len(plain) == len(dcp) else float("inf")


if __name__ == "__main__":
    sys.exit(main())
