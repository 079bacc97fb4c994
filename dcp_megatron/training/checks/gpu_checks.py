"""Start-up checks for the GPU path of a --dcp run: FP8 recipes, apex's fusion kernel, the row alignment.

Called once per start from training/arguments.py's `start_megatron_run` (after Megatron's own validation, before
any model is built); without --dcp it only warns that --fp8-format does nothing on a machine without Transformer
Engine on a GPU:
- FP8 settings --dcp cannot run are refused with one line (fp8_checks.py says why each is unsafe);
- Megatron's default gradient-accumulation fusion needs apex's `fused_weight_gradient_mlp_cuda` in its
  own output layer (`ColumnParallelLinear` raises at model build without it, tensor_parallel/layers.py);
  without the kernel the fusion is turned off here, and the run says so;
- `--dcp-row-alignment` is checked (a positive even number).
"""
from __future__ import annotations

import argparse
import os

from dcp_megatron.flags.fp8_checks import DeviceFacts, fp8_refusal


def check_gpu_path(args: argparse.Namespace, device: DeviceFacts | None = None) -> None:
    """Raise DcpUsageError for what --dcp cannot run here; turn off what cannot work, and say so."""
    from dcp_megatron.config import DcpUsageError

    device = DeviceFacts.of_this_machine() if device is None else device
    if not getattr(args, "dcp", False):
        if getattr(args, "fp8", None) is not None and not device.has_transformer_engine:
            # Megatron's own path: not ours to refuse, but not to pass over in silence either
            _say(args, f"dcp: warning: --fp8-format {args.fp8} has no effect without Transformer Engine on a GPU; "
                       "this run's GEMMs are not FP8")
        return
    refusal = fp8_refusal(args, device)
    if refusal is not None:
        raise DcpUsageError(refusal)
    alignment = getattr(args, "dcp_row_alignment", None)
    if alignment is not None and (alignment < 2 or alignment % 2):
        raise DcpUsageError(f"--dcp-row-alignment must be an even number >= 2 (rows per rank are a sum of "
                            f"even shard lengths), got {alignment}")
    if getattr(args, "gradient_accumulation_fusion", False) and not device.has_apex_wgrad_fusion:
        args.gradient_accumulation_fusion = False
        _say(args, "dcp: apex's fused_weight_gradient_mlp_cuda is not installed, so gradient-accumulation "
                   "fusion is off (as with --no-gradient-accumulation-fusion); install apex with its CUDA "
                   "extensions to keep it")


def _say(args: argparse.Namespace, line: str) -> None:
    if int(os.environ.get("RANK", getattr(args, "rank", 0) or 0)) == 0:
        print(line, flush=True)
