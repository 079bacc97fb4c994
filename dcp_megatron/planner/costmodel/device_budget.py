"""The cluster preset and memory budget of a run, from what was read of its device (docs/gpu.md, "The device").

The runtime reads the device once (runtime/device_memory.py: name, total and free memory, what torch's allocator
holds); this module turns that reading into the run's preset and `mem_bytes_per_gpu`, so the rule is tested on CPU
with made-up readings. Pure Python.

- Preset, by the device's name: H100 SXM / PCIe, H200, A100 40 / 80 GB, B200 (cluster_gpu.py's datasheets); any
  other device gets the nearest (by memory) with a note naming `dcp-profile` as the way to measure it.
- Budget (the memory the plans fill: the cost model's `mem_bytes_per_gpu`, weights, gradients, optimizer states and
  NCCL communicators included, which the cost model counts itself as its static bytes):
  what torch's allocator can still reach (free memory + its own cache; at most the `--dcp-device-memory-gb` cap)
  less what the run holds beyond the static bytes the cost model counts (held memory the count misses). The
  reserve kept out of it: the CUDA context and whatever else holds device memory outside torch at the reading
  (total - free - torch's cache: never reachable), the NCCL communicators the count adds (gpu_costs.py, in the
  static bytes), and allocator fragmentation (the cluster's safety margin, 10%, taken off by the planner).
- `--dcp-memory-budget-gb` overrides it; one above what the device (or the cap) allows is kept, with one line
  saying so: plans may then overrun the device (a run that does survives each out-of-memory, docs/reliability.md).
- Without a device (CPU): the cpu preset, and a `--dcp-device-memory-gb` is the budget (the emulated device).
"""
from __future__ import annotations

from dataclasses import dataclass

GiB = 1024 ** 3

# (substrings of the device's name, all of which must appear; the memory that tells 40 from 80 GB) -> preset
_BY_NAME = (("h200", "h200"), ("b200", "b200"), ("gb200", "b200"), ("h100 pcie", "h100-pcie"),
            ("h100", "h100-sxm"), ("a100", None))
# the presets by memory (bytes), for a device no name matches
_BY_MEMORY = (("a100-40gb", 40e9), ("h100-sxm", 80e9), ("h200", 141e9), ("b200", 180e9))


@dataclass(frozen=True, kw_only=True)
class DeviceReading:
    """One device as read at start (runtime/device_memory.read_device)."""

    name: str
    total_bytes: int        # torch.cuda.get_device_properties(d).total_memory
    free_bytes: int         # torch.cuda.mem_get_info(d)[0]: free on the device (every process)
    allocated_bytes: int    # torch.cuda.memory_allocated(d): what this run holds
    reserved_bytes: int     # torch.cuda.memory_reserved(d): torch's cache (allocated included)
    cap_bytes: int | None = None   # the per-process cap set from --dcp-device-memory-gb, None: none

    def __post_init__(self) -> None:
        for field in ("total_bytes", "free_bytes", "allocated_bytes", "reserved_bytes"):
            if getattr(self, field) < 0:
                raise ValueError(f"DeviceReading.{field} must be >= 0, got {getattr(self, field)}")

    @property
    def reachable_bytes(self) -> int:
        """What torch's allocator can hold in all: its cache plus what is free, at most the cap."""
        reachable = self.free_bytes + self.reserved_bytes
        return min(reachable, self.cap_bytes) if self.cap_bytes is not None else reachable

    @property
    def outside_bytes(self) -> int:
        """Device memory held outside torch's allocator (CUDA context, NCCL, other processes)."""
        return max(0, self.total_bytes - self.free_bytes - self.reserved_bytes)


@dataclass(frozen=True)
class DeviceChoice:
    preset: str                     # cluster preset name
    mem_bytes_per_gpu: int | None   # the budget; None: the preset's own (CPU without a device size)
    lines: tuple[str, ...]          # what the start says (the reading and the budget; a note; an override)


def preset_for_device(name: str, total_bytes: int) -> tuple[str, str | None]:
    """(preset, None) for a known device name; (nearest preset by memory, the note saying so) otherwise."""
    lowered = name.lower()
    for needle, preset in _BY_NAME:
        if needle in lowered:
            if preset is None:   # A100: by its memory
                preset = "a100-40gb" if total_bytes < 60e9 else "a100-80gb"
            return preset, None
    nearest = min(_BY_MEMORY, key=lambda item: abs(item[1] - total_bytes))[0]
    return nearest, (f"dcp: no cluster preset for {name!r}: planning with {nearest}'s rates and bandwidths (the "
                     f"nearest by memory); measure this device with `dcp-profile` and pass --dcp-profile")


def choose_device_budget(reading: DeviceReading | None, *, static_bytes: int, memory_budget_gb: float | None,
                         device_memory_gb: float | None, safety_frac: float) -> DeviceChoice:
    """The preset and budget of a run (the module docstring); `static_bytes`: what the cost model counts as static
    (weights, gradients, optimizer states, FP8 copies, NCCL communicators), `safety_frac` the preset's margin."""
    given = None if memory_budget_gb is None else int(memory_budget_gb * GiB)
    if reading is None:     # CPU: the device is the emulated one (--dcp-device-memory-gb) or none
        limit = None if device_memory_gb is None else int(device_memory_gb * GiB)
        lines = []
        if given is not None and limit is not None and given > limit:
            lines.append(_over(memory_budget_gb, f"--dcp-device-memory-gb {device_memory_gb:g}"))
        return DeviceChoice("cpu", given if given is not None else limit, tuple(lines))
    preset, note = preset_for_device(reading.name, reading.total_bytes)
    uncounted = max(0, reading.allocated_bytes - static_bytes)
    budget = max(1, reading.reachable_bytes - uncounted)
    cap_flag = ("a per-process memory fraction" if device_memory_gb is None
                else f"--dcp-device-memory-gb {device_memory_gb:g}")
    cap = "" if reading.cap_bytes is None else f", capped at {reading.cap_bytes / GiB:.1f} GiB by {cap_flag}"
    read = (f"dcp: device {reading.name}: {reading.total_bytes / GiB:.1f} GiB, {reading.free_bytes / GiB:.1f} free"
            f"{cap}; the run holds {reading.allocated_bytes / GiB:.2f} GiB (the count's static "
            f"{static_bytes / GiB:.2f}); preset {preset}")
    if given is None:
        chosen = (f"budget {budget / GiB:.2f} GiB (what torch can reach, {reading.reachable_bytes / GiB:.2f}, less "
                  f"{uncounted / GiB:.2f} held beyond the count; {reading.outside_bytes / GiB:.2f} held outside "
                  f"torch is not reachable), plans fill {budget * (1 - safety_frac) / GiB:.2f} after the "
                  f"{safety_frac:.0%} margin, {static_bytes / GiB:.2f} of it static")
        lines = [f"{read}; {chosen}"]
    else:
        lines = [f"{read}; budget --dcp-memory-budget-gb {memory_budget_gb:g}"]
        if given > budget:
            what = "the device" if reading.cap_bytes is None else cap_flag
            lines.append(_over(memory_budget_gb, f"{what} ({budget / GiB:.2f} GiB reachable)"))
    if note:
        lines.append(note)
    return DeviceChoice(preset, given if given is not None else budget, tuple(lines))


def _over(memory_budget_gb: float, allows: str) -> str:
    return (f"dcp: --dcp-memory-budget-gb {memory_budget_gb:g} is above what {allows} allows: kept; plans may "
            f"overrun the device, and each out-of-memory is handled as docs/reliability.md says")
