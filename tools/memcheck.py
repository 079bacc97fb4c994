#!/usr/bin/env python3
"""dcp-memcheck: the planner's memory count against megatron-core's real tensors, per relief, at real shapes.

    PYTHONPATH=. .venv/bin/python tools/memcheck.py [--preset llama3-8b qwen2.5-32b mixtral-8x7b] [--layers 3]
        [--documents 4096,2048,2048] [--unfused-swiglu] [--json OUT.json]

For each preset it builds megatron-core 0.19.2's GPTModel with `--layers` of the preset's layers at its real
hidden sizes and vocabulary (local layer spec, bf16, TP 1, CP 1) on the `meta` device, so nothing is allocated
and a 64K-token micro-batch takes a second (dcp_megatron/core/memcheck.py), and runs one THD-packed micro-batch of
`--documents` through forward, loss and backward once per relief of the planner's menu (CostModel's
`recompute_options()` on an H200 cluster: none, every undominated recompute-module and offload set, full recompute
of 1..layers). Per relief it prints, per local token:

- saved: the bytes the layers saved for backward (saved-tensor hooks, each storage once: views and tensors saved
  twice are one allocation) against the planner's `layer_bytes_per_local_token`;
- peak: the peak of live bytes over forward, loss and backward (a TorchDispatchMode following every storage an
  operator returns; weights and their gradients not counted) against the planner's `bytes_per_local_token`
  (static state apart);

and the relative errors. The planner counts the same run: the preset at `--layers` layers with the
`ActivationSpec` the stack ran (planner/costmodel/memory_spec.py: bf16, the local spec's torch norm and RoPE, fused or
unfused SwiGLU, a flash-attention kernel that keeps v as handed). Offload runs no copy (it needs CUDA streams): the
relief's recompute modules run and megatron-core's bookkeeping is applied to what that forward saved: each offload
group frees the bytes saved only inside its modules (attention.py: `core_attn` the core attention's, `attn_proj`
linear_proj's) on every layer but the last of the stage (its `_offload_margin`) and one more whose copy is in flight.
`layernorm` recompute runs with patches/tensor_parallel_random.py's `checkpoint_without_output_patches` (megatron-core's
CheckpointWithoutOutput takes Transformer Engine's FP8 path whenever it is built without arguments). Reliefs that
cannot run here are listed as "not run": `moe_act` recompute and the `expert_fc1` / `moe_act` offloads
(megatron-core runs them in TE's grouped experts only).
The MoE preset routes every token as balanced top-k (core/memcheck.py's BalancedRouting: meta tensors hold no
router scores). Exit status 1 when any relief's saved or peak error exceeds --tolerance (2%).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dcp_megatron.planner.costmodel import CostModel, cluster_preset, model_preset  # noqa: E402
pass  # noqa: E402
from dcp_megatron.planner.costmodel.memory_spec import LOCAL_BF16  # noqa: E402
pass  # noqa: E402
from dcp_megatron.planner.plan import Recompute  # noqa: E402
from dcp_megatron.planner.costmodel.relief import MENU_NAMES, OFFLOAD_KEPT_LAYERS  # noqa: E402

NOT_RUN = {"moe_act": "grouped experts only", "expert_fc1": "grouped experts only"}


def counted_model(preset: str, layers: int, *, unfused_swiglu: bool) -> CostModel:
    spec = dataclasses.replace(LOCAL_BF16, swiglu="unfused" if unfused_swiglu else "fused")
    shape = dataclasses.replace(model_preset(preset), num_layers=layers, transformer_impl="local", activations=spec)
    return CostModel(shape, cluster_preset("h200", domain_size=8), allowed_recompute=MENU_NAMES)


def check_relief(cost: CostModel, relief: Recompute, documents: list[int], *, unfused_swiglu: bool) -> dict:
    """One relief: counted and measured bytes per local token (see the module docstring)."""
    from dcp_megatron.core.memcheck import measure

    tokens = sum(documents)
    row = {"relief": str(relief), "saved_counted": cost.layer_bytes_per_local_token(relief),
           "peak_counted": cost.bytes_per_local_token(relief)}
    blocked = sorted(m for m in relief.modules | relief.offload if m in NOT_RUN)
    if blocked:
        return {**row, "not_run": "; ".join(f"{m}: {NOT_RUN[m]}" for m in blocked)}
    ran = Recompute(relief.kind, relief.full_layers, modules=relief.modules) if relief.kind == "full" else \
        Recompute(relief.kind, modules=relief.modules)
    got = measure(cost.model, ran, documents=documents, fused_swiglu=not unfused_swiglu)
    saved, peak = sum(got.layer_saved), got.peak
    if relief.offload:
        freed_layers = max(cost.layers_per_stage - OFFLOAD_KEPT_LAYERS, 0)
        moved = got.offloadable[tuple(sorted(relief.offload))] * freed_layers
        saved, peak = saved - moved, peak - moved
    row.update(saved_measured=saved / tokens, peak_measured=peak / tokens)
    row["saved_error"] = row["saved_counted"] / row["saved_measured"] - 1
    row["peak_error"] = row["peak_counted"] / row["peak_measured"] - 1
    return row


def check_preset(preset: str, layers: int, documents: list[int], *, unfused_swiglu: bool, only=None) -> list[dict]:
    """Every relief of the menu (`only`: those whose names it holds)."""
    cost = counted_model(preset, layers, unfused_swiglu=unfused_swiglu)
    return [check_relief(cost, r, documents, unfused_swiglu=unfused_swiglu) for r in cost.recompute_options()
            if only is None or str(r) in only]


def table(preset: str, rows: list[dict]) -> str:
    lines = [f"{preset}: bytes per local token", "| relief | saved counted | measured | error | peak counted | "
             "measured | error |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "not_run" in r:
            lines.append(f"| {r['relief']} | {r['saved_counted']:,.0f} | not run ({r['not_run']}) | | "
                         f"{r['peak_counted']:,.0f} | | |")
            continue
        lines.append(f"| {r['relief']} | {r['saved_counted']:,.0f} | {r['saved_measured']:,.0f} | "
                     f"{100 * r['saved_error']:+.2f}% | {r['peak_counted']:,.0f} | {r['peak_measured']:,.0f} | "
                     f"{100 * r['peak_error']:+.2f}% |")
    return "\n".join(lines)


@contextlib.contextmanager
def measuring():
    """The patch sets the meta stack runs under and a one-rank world (dcp_megatron/core/memcheck.py)."""
    from dcp_megatron.core.memcheck import init_single_process
    from patches.megatron_set import megatron_patch_registry
    from patches.registry import PatchRegistry
    from patches.tensor_parallel_random import checkpoint_without_output_patches

    with megatron_patch_registry(), PatchRegistry(checkpoint_without_output_patches()):
        init_single_process()
        yield


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", nargs="+", default=["llama3-8b", "qwen2.5-32b", "mixtral-8x7b"])
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--documents", default="4096,2048,2048", help="document lengths of the micro-batch")
    parser.add_argument("--unfused-swiglu", action="store_true", help="mlp.py's glu instead of bias_swiglu")
    parser.add_argument("--tolerance", type=float, default=0.02)
    parser.add_argument("--json", help="write every row here")
    args = parser.parse_args(argv)
    documents = [int(x) for x in args.documents.split(",")]
    if args.layers < 1 or not documents or min(documents) < 1:
        raise SystemExit("--layers and every --documents length must be positive")
    results, worst = {}, 0.0
    with measuring():
        for preset in args.preset:
            rows = check_preset(preset, args.layers, documents, unfused_swiglu=args.unfused_swiglu)
            results[preset] = rows
            print(table(preset, rows) + "\n", flush=True)
            worst = max([worst] + [abs(r[k]) for r in rows for k in ("saved_error", "peak_error") if k in r])
    print(f"documents {documents} ({sum(documents)} tokens), {args.layers} layers, worst error {100 * worst:.2f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"documents": documents, "layers": args.layers, "results": results}, f, indent=1)
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
