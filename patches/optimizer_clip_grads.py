"""CPU shims for `megatron.core.optimizer.clip_grads`.

- its tensors for grad-norm and zero-count reductions are created with device='cuda';
- `clip_grad_by_total_norm_fp32` asserts every gradient is a 'torch.cuda.FloatTensor'.
"""
from __future__ import annotations

from typing import Iterable, Union

import torch

from patches.cpu_torch import CpuTorch
from patches import MEGATRON_CORE_VERSIONS
from patches.registry import Patch

_MODULE = "megatron.core.optimizer.clip_grads"


@torch.no_grad()
def clip_grad_by_total_norm_cpu(
    parameters: Union[Iterable[torch.Tensor], torch.Tensor],
    max_norm: float,
    total_norm: float,
    use_decoupled_grad: bool = False,
) -> None:
    """Scale every fp32 gradient in place by max_norm / total_norm when that is below 1."""
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff >= 1.0:
        return
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    for param in parameters:
        grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
        if grad is not None:
            if grad.dtype not in (torch.float32, torch.bfloat16):
                raise TypeError(f"gradient clipping expects fp32/bf16 gradients, got {grad.dtype}")
            grad.mul_(clip_coeff)


CPU_PATCHES = (
    Patch(
        target=f"{_MODULE}:torch",
        replacement=CpuTorch(),
        reason="grad-norm and zero-count reductions create their tensors with device='cuda'.",
        versions=MEGATRON_CORE_VERSIONS,
        rebind_aliases=False,
    ),
    Patch(
        target=f"{_MODULE}:clip_grad_by_total_norm_fp32",
        replacement=clip_grad_by_total_norm_cpu,
        reason="asserts every gradient is a 'torch.cuda.FloatTensor'.",
        versions=MEGATRON_CORE_VERSIONS,
    ),
)
