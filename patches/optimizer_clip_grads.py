"""CPU shim for `megatron.core.optimizer.clip_grads`: grad-norm and zero-count reductions create their tensors with device='cuda'."""
from dcp_megatron.megatron.cpu_torch import CpuTorch
from patches import MEGATRON_CORE_VERSIONS
from patches.registry import Patch

CPU_PATCHES = (
    Patch(
        target="megatron.core.optimizer.clip_grads:torch",
        replacement=CpuTorch(),
        reason="grad-norm and zero-count reductions create their tensors with device='cuda'.",
        versions=MEGATRON_CORE_VERSIONS,
        # Only this module's view of torch changes; other modules keep the real one.
        rebind_aliases=False,
    ),
)
