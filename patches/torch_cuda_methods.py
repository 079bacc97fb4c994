"""CPU shims for torch's own `.cuda()` methods (active only without a GPU).

megatron.training moves modules and batches with `module.cuda(...)` / `tensor.cuda(...)`
(model placement in `models/dist_utils.py`, every batch key in a pretrain script's `get_batch`).
On a CPU-only machine the data already lives where it will be used, so both return the object
itself. These are the only patches on torch; they are reversible like every other entry.
"""
from __future__ import annotations

import torch

from patches import MEGATRON_CORE_VERSIONS
from patches.registry import Patch


def _tensor_stays(self: torch.Tensor, device=None, non_blocking: bool = False, **kwargs) -> torch.Tensor:
    return self


def _module_stays(self: torch.nn.Module, device=None) -> torch.nn.Module:
    return self


CPU_PATCHES = (
    Patch(target="torch:Tensor.cuda", replacement=_tensor_stays,
          reason="batches and buffers are moved with tensor.cuda() by megatron.training and pretrain scripts.",
          versions=MEGATRON_CORE_VERSIONS),
    Patch(target="torch.nn:Module.cuda", replacement=_module_stays,
          reason="model chunks are placed with module.cuda(current_device) before DDP wrapping.",
          versions=MEGATRON_CORE_VERSIONS),
)
