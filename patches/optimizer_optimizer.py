"""CPU shim for `megatron.core.optimizer.optimizer`: FP32Optimizer and the chained optimizer create their loss-scale tensors with device='cuda'."""
from dcp_megatron.megatron.cpu_torch import CpuTorch
from patches import MEGATRON_CORE_VERSIONS
from patches.registry import Patch

CPU_PATCHES = (
    Patch(
        target="megatron.core.optimizer.optimizer:torch",
        replacement=CpuTorch(),
        reason="FP32Optimizer and the chained optimizer create their loss-scale tensors with device='cuda'.",
        versions=MEGATRON_CORE_VERSIONS,
        # Only this module's view of torch changes; other modules keep the real one.
        rebind_aliases=False,
    ),
)
