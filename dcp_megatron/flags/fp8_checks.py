"""FP8 under --dcp: which recipes are safe when ranks run different numbers of micro-batches.

Read against megatron-core 0.19.2 and Transformer Engine 2.17.1 (docs/gpu.md):
- delayed scaling all-reduces amax (MAX) over Megatron's amax group, TP x DP x CP = the whole DCP
  domain (fp8_utils.get_fp8_context), once per micro-batch forward (autocast exit) and again in
  backward; ranks running 8 and 9 micro-batches would issue different numbers of collectives. Megatron
  0.19.2 has no command-line flag for `tp_only_amax_red` (its argument builder excludes it), so from
  the command line delayed scaling is refused; a config that sets it is allowed.
- tensorwise (TE's Float8CurrentScaling) reduces amax only over the TP group, for sequence-parallel
  inputs (TE module/linear.py, layernorm_linear.py: `amax_reduction_group = self.tp_group`); TP peers
  run the same micro-batches and the same recompute, so the collectives match. TE's global amax buffer,
  the only thing reduced at autocast exit, stays empty for it (quantization.py, autocast_exit).
- blockwise (Float8BlockScaling) reduces no amax; TE needs CUDA >= 12.9 for its kernels.
- mxfp8 needs Blackwell (compute capability 10); H200 is 9.0. custom recipes are refused (their
  collectives are unknown). FP8 attention has no TE backend for THD with CP (TE dot_product_attention
  utils: FusedAttention refuses FP8 THD under CP, FlashAttention refuses CP with FP8).
"""
from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass

SAFE_RECIPES = ("tensorwise", "blockwise")
BLOCKWISE_MIN_CUDA = (12, 9)
MXFP8_MIN_CAPABILITY = (10, 0)
# TE's FP8 GEMMs need the token rows (per TP shard under sequence parallelism) divisible by 16
# (TE 2.17.1 pytorch/utils.py, assert_dim_for_fp8_exec / the cuBLASLt FP8 alignment).
FP8_ROW_MULTIPLE = 16


@dataclass(frozen=True, kw_only=True)
class DeviceFacts:
    """What this machine offers the GPU path (built once at start-up; tests give their own)."""

    has_gpu: bool
    has_transformer_engine: bool
    capability: tuple[int, int] | None = None    # CUDA compute capability of the current device
    cuda_version: tuple[int, int] | None = None  # torch's CUDA runtime
    has_apex_wgrad_fusion: bool = False          # apex's fused_weight_gradient_mlp_cuda

    @classmethod
    def of_this_machine(cls) -> "DeviceFacts":
        import torch

        has_gpu = torch.cuda.is_available()
        cuda = tuple(int(p) for p in torch.version.cuda.split(".")[:2]) if torch.version.cuda else None
        return cls(has_gpu=has_gpu,
                   # an importable TE without CUDA breaks megatron.core: TE counts only with a GPU
                   has_transformer_engine=has_gpu and importlib.util.find_spec("transformer_engine") is not None,
                   capability=tuple(torch.cuda.get_device_capability()) if has_gpu else None,
                   cuda_version=cuda,
                   has_apex_wgrad_fusion=importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None)


def fp8_refusal(args: argparse.Namespace, device: DeviceFacts) -> str | None:
    """Why this run's FP8 settings cannot run under --dcp (one line naming the flag), or None."""
    if getattr(args, "fp8", None) is None:
        return None
    if not (device.has_gpu and device.has_transformer_engine):
        return (f"--fp8-format {args.fp8} needs Transformer Engine on a GPU, and this machine has "
                f"{'no GPU' if not device.has_gpu else 'no transformer_engine'}: drop --fp8-format "
                "(or install the [gpu] extra on a GPU machine)")
    recipe = getattr(args, "fp8_recipe", "delayed")
    if recipe == "delayed" and not getattr(args, "tp_only_amax_red", False):
        return ("--fp8-recipe delayed all-reduces amax over the whole DP x CP domain once per micro-batch, "
                "and under --dcp ranks run different numbers of micro-batches, so the reductions would not "
                "match: use --fp8-recipe tensorwise (or blockwise)")
    if recipe == "mxfp8" and (device.capability or (0, 0)) < MXFP8_MIN_CAPABILITY:
        return (f"--fp8-recipe mxfp8 needs a Blackwell GPU (compute capability 10), this one is "
                f"{_dotted(device.capability)}: use --fp8-recipe tensorwise")
    if recipe == "blockwise" and (device.cuda_version or (0, 0)) < BLOCKWISE_MIN_CUDA:
        return (f"--fp8-recipe blockwise needs CUDA >= 12.9 for Transformer Engine's block-scaled kernels, "
                f"torch runs CUDA {_dotted(device.cuda_version)}: use --fp8-recipe tensorwise")
    if recipe not in SAFE_RECIPES + ("delayed", "mxfp8"):
        return (f"--fp8-recipe {recipe} is not supported with --dcp (its amax collectives are unknown; "
                "ranks run different numbers of micro-batches): use --fp8-recipe tensorwise")
    for name in ("fp8_dot_product_attention", "fp8_multi_head_attention"):
        if getattr(args, name, False):
            return (f"{name} is not supported with --dcp: no Transformer Engine backend runs FP8 attention on "
                    "packed (THD) sequences with context parallelism; leave attention in bf16")
    return None


def fp8_row_multiple(args: argparse.Namespace) -> int:
    """The multiple every micro-batch's token rows on a rank are padded to (1: no padding).

    Under FP8: 16 rows per TP shard when sequence parallelism splits the rows over TP, else 16.
    `--dcp-row-alignment N` asks for it without FP8 (tests run the alignment on CPU that way)."""
    given = getattr(args, "dcp_row_alignment", None)
    if given is not None:
        return given
    if getattr(args, "fp8", None) is None:
        return 1
    shards = args.tensor_model_parallel_size if getattr(args, "sequence_parallel", False) else 1
    return FP8_ROW_MULTIPLE * shards


def _dotted(version: tuple[int, int] | None) -> str:
    return "unknown" if version is None else ".".join(str(v) for v in version)
