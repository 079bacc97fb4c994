"""CPU shim for `megatron.core.tensor_parallel.mappings`: sequence-parallel all-gather / reduce-scatter outputs are allocated on torch.cuda.current_device()."""
from dcp_megatron.megatron.cpu_torch import CpuTorch
from patches import MEGATRON_CORE_VERSIONS
from patches.registry import Patch

CPU_PATCHES = (
    Patch(
        target="megatron.core.tensor_parallel.mappings:torch",
        replacement=CpuTorch(),
        reason="sequence-parallel all-gather / reduce-scatter outputs are allocated on torch.cuda.current_device().",
        versions=MEGATRON_CORE_VERSIONS,
        # Only this module's view of torch changes; other modules keep the real one.
        rebind_aliases=False,
    ),
)
