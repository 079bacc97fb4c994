"""CPU shims for `megatron.training.initialize` (active only without a GPU).

- `initialize_megatron` asserts CUDA unless `allow_no_cuda=True`, which `pretrain()` never passes;
- `_compile_dependencies` runs `make` for the dataset helpers, but the 0.19.2 wheel ships them
  compiled (`helpers_cpp`) and has no Makefile; the fused-kernel part of it is GPU-only;
- the module's `torch` asks for devices, streams and CUDA RNG seeds: a CPU view (`CpuTorch`)
  reports one device per process, so model-parallel state is still initialised.
"""
from __future__ import annotations

import functools

from patches.cpu_torch import CpuTorch
from patches import MEGATRON_CORE_VERSIONS
from patches.registry import Patch

_MODULE = "megatron.training.initialize"


def _allow_no_cuda(original):
    @functools.wraps(original)
    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    initialize_megatron.dcp_original = original
    return initialize_megatron


def _skip_compile() -> None:
    """The wheel's dataset helpers are already compiled; nothing else here is needed on CPU."""
    import torch

    from megatron.core.datasets import helpers_cpp  # noqa: F401 - fail here, clearly, if missing
    torch.distributed.barrier()


def cpu_patches() -> tuple[Patch, ...]:
    import importlib

    module = importlib.import_module(_MODULE)
    original = getattr(module.initialize_megatron, "dcp_original", module.initialize_megatron)
    return (
        Patch(target=f"{_MODULE}:initialize_megatron", replacement=_allow_no_cuda(original),
              reason="asserts torch.cuda.is_available() unless allow_no_cuda, which pretrain() does not pass.",
              versions=MEGATRON_CORE_VERSIONS),
        Patch(target=f"{_MODULE}:_compile_dependencies", replacement=_skip_compile,
              reason="runs make for dataset helpers the wheel already ships compiled (no Makefile in the wheel).",
              versions=MEGATRON_CORE_VERSIONS),
        Patch(target=f"{_MODULE}:torch", replacement=CpuTorch(),
              reason="device count, set_device, streams and CUDA seeding during start-up.",
              versions=MEGATRON_CORE_VERSIONS, rebind_aliases=False),
    )
