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

import contextlib
import functools
import types
from typing import Any, Callable

import torch

_CPU = torch.device("cpu")
# Factories whose `device=` keyword upstream code sets to CUDA.
_FACTORY_NAMES = ("empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "randint", "as_tensor",
                  "empty_like", "zeros_like", "ones_like", "full_like")


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

    # One "device" per process: megatron.training initialises model parallelism only when it sees
    # a device, and pins each rank to its local one.
    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def set_device(device: Any) -> None:
        return None

    @staticmethod
    def set_stream(stream: Any) -> None:
        return None

    @staticmethod
    def current_stream(device: Any = None) -> "CpuStream":
        return CpuStream()

    @staticmethod
    def Stream(*args: Any, **kwargs: Any) -> "CpuStream":  # noqa: N802 - mirrors torch.cuda.Stream
        return CpuStream()

    @staticmethod
    def Event(*args: Any, **kwargs: Any) -> "CpuEvent":  # noqa: N802 - mirrors torch.cuda.Event
        return CpuEvent()

    @staticmethod
    def stream(stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return 0

    max_memory_allocated = memory_reserved = max_memory_reserved = memory_allocated

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
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


class CpuStream:
    """A CUDA stream stand-in: work on CPU is already ordered, so waits and syncs are no-ops."""

    def wait_stream(self, other: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def record_event(self, event: Any = None) -> "CpuEvent":
        # MoE's alltoall dispatcher synchronizes on the event this returns.
        return event if event is not None else CpuEvent()


class CpuEvent:
    """A CUDA event stand-in: CPU work is complete when it is recorded."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        return None

    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def __enter__(self) -> "CpuStream":
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class CpuTorch(types.ModuleType):
    """The real `torch`, except that CUDA device requests land on CPU (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = CpuCuda()
        for name in _FACTORY_NAMES:
            setattr(self, name, _on_cpu(getattr(torch, name)))

    @staticmethod
    def device(*args: Any, **kwargs: Any) -> torch.device:
        """torch.device, with CUDA specs (`"cuda:1"`, `("cuda", 1)`) mapped to the CPU."""
        if args and (cpu_device(args[0]) is _CPU or cpu_device(kwargs.get("type")) is _CPU):
            return _CPU
        return torch.device(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def get_cpu_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """Replacement for megatron's `_get_cuda_rng_state`: the CPU generator's state."""
    state = torch.get_rng_state()
    return state.clone() if clone else state


def set_cpu_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    """Replacement for megatron's `_set_cuda_rng_state`."""
    torch.set_rng_state(new_state)


def cpu_torch_patch(module: str, reason: str, versions: str):
    """The registry entry that binds a `CpuTorch` as `torch` inside one upstream module."""
    from patches.registry import Patch

    # Only this module's view of torch changes; other modules keep the real one.
    return Patch(target=f"{module}:torch", replacement=CpuTorch(), reason=reason, versions=versions,
                 rebind_aliases=False)
