"""CPU shim for `megatron.core.utils`: GlobalMemoryBuffer allocates on torch.cuda.current_device() (sequence-parallel all-gather buffers)."""
from dcp_megatron.megatron.cpu_torch import CpuTorch
from patches import MEGATRON_CORE_VERSIONS
from patches.registry import Patch

CPU_PATCHES = (
    Patch(
        target="megatron.core.utils:torch",
        replacement=CpuTorch(),
        reason="GlobalMemoryBuffer allocates on torch.cuda.current_device() (sequence-parallel all-gather buffers).",
        versions=MEGATRON_CORE_VERSIONS,
        # Only this module's view of torch changes; other modules keep the real one.
        rebind_aliases=False,
    ),
)
