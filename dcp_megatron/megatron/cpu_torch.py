"""A CPU view of the `torch` module, bound as `torch` inside selected upstream modules.

megatron-core hard-codes CUDA in a few places on the training path (`device="cuda"`,
`torch.cuda.current_device()`, `torch.cuda.synchronize()`, the CUDA RNG). On a machine
without a GPU we rebind the global name `torch` of exactly those upstream modules (one patch
per module, see patches/) to a `CpuTorch` object: everything is the real torch except that
device requests for CUDA become CPU and `torch.cuda` answers as a CPU-only runtime would
(no-op synchronize, CPU RNG state). Unlike a `TorchFunctionMode`, this also holds during
backward and recompute, which run outside any Python context the forward set up.
"""
from __future__ import annotations

import functools
import types
from typing import Any, Callable

import torch

_CPU = torch.device("cpu")
# Factories whose `device=` keyword upstream code sets to CUDA.
_FACTORY_NAMES = ("empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "randint", "as_tensor")


def cpu_device(device: Any) -> Any:
    """Map a CUDA device spec (str, torch.device or a bare CUDA index) to CPU; keep others."""
    if isinstance(device, int) and not isinstance(device, bool):
        return _CPU
    if isinstance(device, str) and device.startswith("cuda"):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


def _on_cpu(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(factory)
    def wrapper(*args: Any, **kwargs: Any) -> torch.Tensor:
        if "device" in kwargs:
            kwargs["device"] = cpu_device(kwargs["device"])
        # Pinned memory needs an accelerator.
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    return wrapper


class CpuCuda(types.ModuleType):
    """`torch.cuda` as seen by a patched module on a CPU-only machine."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def is_available() -> bool:
        return False

    @staticmethod
    def current_device() -> torch.device:
        return _CPU

    @staticmethod
    def synchronize(device: Any = None) -> None:
        # Collectives on gloo are synchronous; there is no device queue to drain.
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    # The "CUDA" RNG of a CPU run is the CPU generator: Megatron saves and restores it around
    # recompute and forks it for tensor-parallel regions, which is exactly what CPU needs.
    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(new_state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(new_state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)


class CpuTorch(types.ModuleType):
    """The real `torch`, except that CUDA device requests land on CPU (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = CpuCuda()
        for name in _FACTORY_NAMES:
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def get_cpu_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """Replacement for megatron's `_get_cuda_rng_state`: the CPU generator's state."""
    state = torch.get_rng_state()
    return state.clone() if clone else state


def set_cpu_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    """Replacement for megatron's `_set_cuda_rng_state`."""
    torch.set_rng_state(new_state)
