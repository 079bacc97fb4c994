"""Patches for `megatron.training.training`.

CPU shim (no GPU only): the module's `torch` is a CPU view, since the loop creates tensors with
device='cuda' (start-up timestamps, loss sums, token counts) and calls torch.cuda
synchronize/empty_cache and memory statistics.

DCP: `train()` takes its schedule from `get_forward_backward_func` (imported by name into this
module). Under `--dcp` the schedule it gets is Megatron's own, wrapped in `DcpForwardBackward`
(dcp_megatron/megatron/schedule.py): each step is planned from its documents' lengths and every
rank runs its own micro-batches through Megatron's schedule. Without `--dcp` nothing changes.
"""
from __future__ import annotations

import functools
import importlib
from datetime import timedelta

from dcp_megatron.megatron.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS
from patches.registry import Patch

_MODULE = "megatron.training.training"

CPU_PATCHES = (cpu_torch_patch(_MODULE, "tensors created with device='cuda' and torch.cuda calls in the loop.",
                               MEGATRON_CORE_VERSIONS),)


def _with_dcp_schedule(original):
    @functools.wraps(original)
    def get_forward_backward_func(*args, **kwargs):
        inner = original(*args, **kwargs)
        from megatron.training import get_args

        run_args = get_args()
        if not getattr(run_args, "dcp", False):
            return inner
        import torch

        from dcp_megatron.megatron.dcp_args import dcp_config_from_args
        from dcp_megatron.megatron.planning import model_shape_from_args
        from dcp_megatron.megatron.schedule import DcpForwardBackward

        return DcpForwardBackward(
            inner, config=dcp_config_from_args(run_args), model_shape=model_shape_from_args(run_args),
            timeout=timedelta(minutes=run_args.distributed_timeout_minutes),
            is_logging_rank=torch.distributed.get_rank() == 0, has_gpu=torch.cuda.is_available(),
            sequence_parallel=bool(run_args.sequence_parallel))

    get_forward_backward_func.dcp_original = original
    return get_forward_backward_func


def dcp_patches() -> tuple[Patch, ...]:
    module = importlib.import_module(_MODULE)
    original = getattr(module.get_forward_backward_func, "dcp_original", module.get_forward_backward_func)
    return (
        Patch(target=f"{_MODULE}:get_forward_backward_func", replacement=_with_dcp_schedule(original),
              reason="under --dcp, train() runs each step's planned micro-batches (a count per rank) through "
                     "Megatron's own schedule.",
              versions=MEGATRON_CORE_VERSIONS, rebind_aliases=False),
    )
