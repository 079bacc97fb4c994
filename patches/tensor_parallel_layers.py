"""CPU shim for `megatron.core.tensor_parallel.layers`: sequence-parallel linear layers all-gather their input into a buffer on torch.cuda.current_device() (forward and backward)."""
from dcp_megatron.megatron.cpu_torch import CpuTorch
from patches import MEGATRON_CORE_VERSIONS
from patches.registry import Patch

CPU_PATCHES = (
    Patch(
        target="megatron.core.tensor_parallel.layers:torch",
        replacement=CpuTorch(),
        reason="sequence-parallel linear layers all-gather their input into a buffer on torch.cuda.current_device() (forward and backward).",
        versions=MEGATRON_CORE_VERSIONS,
        # Only this module's view of torch changes; other modules keep the real one.
        rebind_aliases=False,
    ),
)
