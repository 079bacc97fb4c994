"""This rank's GPU, read once at start, and the per-process cap of `--dcp-device-memory-gb` (torch only).

`read_device` returns what planner/costmodel/device_budget.py chooses the preset and budget from: the device's name and
total memory (`torch.cuda.get_device_properties`), its free memory (`torch.cuda.mem_get_info`, every process),
and what this process's allocator holds (`memory_allocated`) and caches (`memory_reserved`). `cap_device_memory`
caps torch's caching allocator on the device (`torch.cuda.set_per_process_memory_fraction`): an allocation past it
raises the real `torch.OutOfMemoryError`. Both take the rank's device explicitly: a start reads it before Megatron
or DeepSpeed calls `torch.cuda.set_device` (LOCAL_RANK's device where torchrun set one).
"""
from __future__ import annotations

import os

import torch

from dcp_megatron.planner.costmodel.device_budget import GiB, DeviceReading


def rank_device() -> int:
    """This rank's CUDA device index: LOCAL_RANK's when it names a visible device, else the current one."""
    local = os.environ.get("LOCAL_RANK", "")
    if local.isdigit() and int(local) < torch.cuda.device_count():
        return int(local)
    return torch.cuda.current_device()


def cap_device_memory(device_memory_gb: float, device: int | None = None) -> str | None:
    """Cap torch's allocator on `device` at `device_memory_gb` GiB; the line to say when the cap is not set (the
    device has less than that), else None."""
    device = rank_device() if device is None else device
    total = torch.cuda.get_device_properties(device).total_memory
    cap = int(device_memory_gb * GiB)
    if cap >= total:
        return (f"dcp: --dcp-device-memory-gb {device_memory_gb:g} is not below the device's {total / GiB:.1f} GiB: "
                "no cap set (the device's own memory bounds the run)")
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    return None


def cap_for_run(device_memory_gb: float | None, *, has_gpu: bool, say=None) -> None:
    """Both engines' start, before the model is built: --dcp-device-memory-gb caps torch's allocator on GPU (`say`
    gets the line when no cap is set); nothing on CPU (the emulated device reads the config) or without the flag."""
    if not has_gpu or device_memory_gb is None:
        return
    line = cap_device_memory(device_memory_gb)
    if line and say is not None:
        say(line)


def read_device(device: int | None = None) -> DeviceReading:
    """This rank's device as the budget rule reads it (the module docstring)."""
    device = rank_device() if device is None else device
    properties = torch.cuda.get_device_properties(device)
    free, total = torch.cuda.mem_get_info(device)
    fraction = torch.cuda.get_per_process_memory_fraction(device)
    return DeviceReading(name=properties.name, total_bytes=int(total), free_bytes=int(free),
                         allocated_bytes=int(torch.cuda.memory_allocated(device)),
                         reserved_bytes=int(torch.cuda.memory_reserved(device)),
                         cap_bytes=int(fraction * total) if fraction < 1.0 else None)
