"""An emulated device memory on CPU (`--dcp-device-memory-gb G` without a GPU): every live tensor byte of the
process counted as it lives, and the allocation that crosses G raises `torch.OutOfMemoryError` where it happens,
as a GPU's allocator would (torch only).

`DeviceCeiling` is a TorchDispatchMode kept open around an engine's training loop. On entry it counts every
storage already alive (a walk of the garbage collector's tensors: weights, gradient buffers, optimizer states
built before the loop); from then on each operator's outputs are followed by storage (views and in-place results
count once) until they die, so the count grows and shrinks incrementally (no sum over live storages per operator).
Operators run by autograd's backward, by a recompute replay inside it (reentrant or not) and by the optimizer go
through the dispatcher on the calling thread under the same mode, so they are counted and can fail too.
Not seen: bytes a library allocates outside torch's dispatcher (gloo's own buffers, numpy arrays), and a storage
resized in place (`untyped_storage().resize_`) keeps the bytes it was born with.
"""
from __future__ import annotations

import gc
import warnings
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

GiB = 1 << 30


class DeviceCeiling(TorchDispatchMode):
    """`with DeviceCeiling(limit_bytes):` counts live tensor bytes (module docstring); `live_bytes`, `peak_bytes`."""

    def __init__(self, limit_bytes: int, existing=None) -> None:
        super().__init__()
        if limit_bytes <= 0:
            raise ValueError(f"the device memory must be positive bytes, got {limit_bytes}")
        self.limit_bytes = int(limit_bytes)
        self.live_bytes = 0
        self.peak_bytes = 0
        self.num_out_of_memory = 0
        self.attempted_bytes: int | None = None   # the live bytes the last failing allocation would have made
        self._followed: set[int] = set()
        self.report = False   # a line with the peak on rank 0 when the loop ends (emulated_device)
        self._existing = existing   # the tensors alive before (None: every tensor the garbage collector knows)

    def __enter__(self) -> "DeviceCeiling":
        if self._existing is not None:
            for tensor in self._existing:
                self._follow(tensor)
            return self._entered()
        gc.collect()   # tensors only garbage cycles still hold are not live
        with warnings.catch_warnings():   # isinstance on deprecated module attributes warns
            warnings.simplefilter("ignore")
            for obj in gc.get_objects():   # what exists before the loop: weights, grads, optimizer states
                if issubclass(type(obj), torch.Tensor):   # (type(): a weak proxy's isinstance may raise)
                    self._follow(obj)
        return self._entered()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        if self.report and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
            print(f"dcp: emulated device: peak {self.peak_bytes / GiB:.4f} GiB of {self.limit_bytes / GiB:.4f} GiB "
                  f"on rank 0", flush=True)

    def _entered(self) -> "DeviceCeiling":
        self.peak_bytes = self.live_bytes
        return super().__enter__()

    def _follow(self, tensor: torch.Tensor) -> None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):   # sparse, nested: no plain storage
            return
        if storage.device.type != "cpu":
            return
        key = storage._cdata
        if key in self._followed:
            return
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        self._followed.add(key)
        self.live_bytes += nbytes
        weakref.finalize(storage, self._forget, key, nbytes)

    def _forget(self, key: int, nbytes: int) -> None:
        self._followed.discard(key)
        self.live_bytes -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        before = self.live_bytes
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._follow(leaf)
        if self.live_bytes > self.limit_bytes:
            attempted = self.live_bytes
            self.num_out_of_memory += 1
            self.attempted_bytes = attempted
            del out    # the allocation that crossed fails: nothing of it survives
            raise torch.OutOfMemoryError(
                f"emulated device out of memory (--dcp-device-memory-gb {self.limit_bytes / GiB:g}): {func} "
                f"allocated {(attempted - before) / GiB:.4f} GiB with {before / GiB:.4f} GiB live; "
                f"{attempted / GiB:.4f} GiB is above the {self.limit_bytes / GiB:.4f} GiB device")
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return out


def active_ceiling() -> DeviceCeiling | None:
    """The DeviceCeiling open on this thread (the innermost), else None."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    found = [mode for mode in _get_current_dispatch_mode_stack() if isinstance(mode, DeviceCeiling)]
    return found[-1] if found else None


def emulated_device(device_memory_gb: float | None):
    """The context a training loop runs in: a DeviceCeiling of `device_memory_gb` GiB without a GPU; nothing
    (no mode, no cost) without the flag or on a GPU (the real allocator raises there)."""
    import contextlib

    if device_memory_gb is None or torch.cuda.is_available():
        return contextlib.nullcontext()
    ceiling = DeviceCeiling(int(device_memory_gb * GiB))
    ceiling.report = True
    return ceiling
