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


def _on_this_attempts_store(original):
    @functools.wraps(original)
    def _initialize_distributed(*args, **kwargs):
        from datetime import timedelta

        from megatron.training import get_args

        from dcp_megatron.runtime.restart_store import init_after_restart

        run_args = get_args()
        store = args[2] if len(args) > 2 else kwargs.get("store")
        if getattr(run_args, "dcp", False) and store is None:   # (a store given: Megatron's in-process restart)
            init_after_restart(backend=run_args.distributed_backend,
                               timeout=timedelta(minutes=run_args.distributed_timeout_minutes))
        return original(*args, **kwargs)

    _initialize_distributed.dcp_original = original
    return _initialize_distributed


def dcp_patches() -> tuple[Patch, ...]:
    """Under --dcp, a worker torchrun restarted (--max-restarts) initializes torch.distributed on a store of its own
    attempt (dcp_megatron/runtime/restart_store.py)."""
    import importlib

    module = importlib.import_module(_MODULE)
    original = getattr(module._initialize_distributed, "dcp_original", module._initialize_distributed)
    return (Patch(target=f"{_MODULE}:_initialize_distributed", replacement=_on_this_attempts_store(original),
                  reason="torchrun's restarted workers share the agent's store with the dead ones (no per-attempt "
                         "prefix in torch's env:// init): gloo reads a dead peer's address. Under --dcp a restarted "
                         "worker initializes on a store prefixed by its attempt first.",
                  versions=MEGATRON_CORE_VERSIONS, rebind_aliases=False),)


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
