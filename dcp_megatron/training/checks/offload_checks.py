"""Start-up checks for activation offload under --dcp (megatron.training): where `offload` can run, the layers are
built with megatron-core's offload machinery; elsewhere one line says why not and what to change.

With `offload` on --dcp-recompute the planner offloads some micro-batches' activations and not others, and
dcp_megatron/core/offload.py switches the layers per micro-batch. That needs, before any model is built:
- a GPU with Transformer Engine: megatron-core's offload manager runs CUDA streams and pinned host memory and
  enters TE's cpu_offload context (megatron.training asserts --transformer-impl transformer_engine for it too);
- NVTE_CPU_OFFLOAD_V1=1 (megatron.training's own check for TE >= 2.10: TE's newer offload would take weights);
- on a MoE model, TE's grouped experts (--moe-grouped-gemm): only TEGroupedMLP offloads expert_fc1 / moe_act,
  which the planner's menu offers for MoE models;
- no --cpu-offloading (megatron-core refuses both), no CUDA graphs (fixed shapes; DCP's change every step);
- upstream's tuning flags at their defaults (--activation-offload-fraction, --delta-offload-bytes-across-pp-ranks,
  --delay-offload-until-cuda-graph): they act on the layout megatron-core freezes after its first step, which
  DCP never freezes (patches/pipeline_parallel_fine_grained_activation_offload.py).
DCP owns the offload flags: it sets --fine-grained-activation-offloading and --offload-modules (every offload of
the menu) itself; given by the user without `offload` on the menu, or with other modules, they are refused.
"""
from __future__ import annotations

import argparse
import os

from dcp_megatron.config import DEFAULT_RECOMPUTE, DcpUsageError, recompute_choices
from dcp_megatron.core.offload import offload_modules_for
from dcp_megatron.flags.fp8_checks import DeviceFacts

_TUNING_DEFAULTS = (("activation_offload_fraction", 1.0), ("delta_offload_bytes_across_pp_ranks", 0),
                    ("delay_offload_until_cuda_graph", False))


def check_offload(args: argparse.Namespace, device: DeviceFacts) -> None:
    """Refuse what --dcp cannot offload here (DcpUsageError, one line); else build the layers with offload."""
    kinds = recompute_choices(getattr(args, "dcp_recompute", None)) or DEFAULT_RECOMPUTE
    user_on = bool(getattr(args, "fine_grained_activation_offloading", False))
    if "offload" not in kinds:
        if user_on:
            raise DcpUsageError("--fine-grained-activation-offloading conflicts with --dcp: DCP chooses offload per "
                                "micro-batch; allow it with --dcp-recompute ...,offload (GPU only)")
        return
    if not device.has_gpu:
        raise DcpUsageError("--dcp-recompute offload: megatron-core's fine-grained activation offloading runs on GPU "
                            "only (CUDA streams, pinned host memory), and this machine has no GPU: drop 'offload' "
                            "here (dcp-simulate still plans it)")
    if not device.has_transformer_engine or getattr(args, "transformer_impl", None) != "transformer_engine":
        raise DcpUsageError("--dcp-recompute offload needs --transformer-impl transformer_engine with Transformer "
                            "Engine installed (megatron-core's offload enters TE's cpu_offload context); drop "
                            "'offload' or run the TE spec")
    if os.environ.get("NVTE_CPU_OFFLOAD_V1", "0") != "1":
        raise DcpUsageError("--dcp-recompute offload needs NVTE_CPU_OFFLOAD_V1=1 in the environment (TE >= 2.10 "
                            "would offload weights too; megatron.training checks the same): export it, or drop "
                            "'offload'")
    is_moe = bool(getattr(args, "num_experts", None))
    if is_moe and not getattr(args, "moe_grouped_gemm", False):
        raise DcpUsageError("--dcp-recompute offload on a MoE model needs --moe-grouped-gemm: megatron-core offloads "
                            "expert_fc1 / moe_act in TE's grouped experts only; add it, or drop 'offload'")
    if getattr(args, "cpu_offloading", False) or (getattr(args, "cpu_offloading_num_layers", 0) or 0) > 0:
        raise DcpUsageError("--cpu-offloading-num-layers conflicts with --dcp-recompute offload (megatron-core runs "
                            "one kind of activation offloading): drop one")
    if getattr(args, "cuda_graph_impl", "none") not in (None, "none"):
        raise DcpUsageError(f"--cuda-graph-impl {args.cuda_graph_impl} conflicts with --dcp-recompute offload: "
                            "graphs need fixed shapes, DCP's micro-batches change every step; drop one")
    for name, default in _TUNING_DEFAULTS:
        if getattr(args, name, default) != default:
            raise DcpUsageError(f"--{name.replace('_', '-')} {getattr(args, name)}: under --dcp the plan chooses "
                                "what each micro-batch offloads (megatron-core's tuning of a frozen first-step "
                                "layout does not apply); drop the flag")
    modules = offload_modules_for(is_moe=is_moe)
    given = list(getattr(args, "offload_modules", None) or [])
    if given and sorted(given) != sorted(modules):
        raise DcpUsageError(f"--offload-modules {' '.join(given)}: under --dcp the planner chooses per micro-batch "
                            f"among {','.join(modules)}; drop --offload-modules")
    args.fine_grained_activation_offloading = True
    args.offload_modules = modules
    if not user_on and int(os.environ.get("RANK", getattr(args, "rank", 0) or 0)) == 0:
        print(f"dcp: --dcp-recompute offload builds the layers with --fine-grained-activation-offloading "
              f"--offload-modules {' '.join(modules)}; each micro-batch's plan switches them", flush=True)
