"""CPU shims for `megatron.core.optimizer.distrib_optimizer` (the distributed optimizer; no GPU only).

- the module's `torch` is a CPU view: shard buffers and reductions use torch.cuda.current_device();
- `DistributedOptimizer._build_model_and_main_param_groups` sorts parameters by the no-argument
  `param.type()` string and refuses anything but 'torch.cuda.*Tensor'. For the duration of that
  one call, `Tensor.type()` (without arguments) names a CPU tensor's CUDA counterpart; nothing
  else sees the change.
"""
from __future__ import annotations

import contextlib
import functools

import torch

from dcp_megatron.megatron.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS
from patches.registry import Patch

_MODULE = "megatron.core.optimizer.distrib_optimizer"


@contextlib.contextmanager
def cuda_type_names():
    """No-argument Tensor.type() reports e.g. 'torch.cuda.FloatTensor' for a CPU float tensor."""
    original = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == "cpu":
            return original(self).replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


def _with_cuda_type_names(original):
    @functools.wraps(original)
    def build(cls, *args, **kwargs):
        with cuda_type_names():
            return original(cls, *args, **kwargs)

    return classmethod(build)


def cpu_patches() -> tuple[Patch, ...]:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = vars(DistributedOptimizer)["_build_model_and_main_param_groups"].__func__
    return (
        cpu_torch_patch(_MODULE, "shard buffers and reductions are created on torch.cuda.current_device().",
                        MEGATRON_CORE_VERSIONS),
        Patch(target=f"{_MODULE}:DistributedOptimizer._build_model_and_main_param_groups",
              replacement=_with_cuda_type_names(original),
              reason="refuses parameters whose no-argument .type() is not 'torch.cuda.*Tensor'.",
              versions=MEGATRON_CORE_VERSIONS),
    )
