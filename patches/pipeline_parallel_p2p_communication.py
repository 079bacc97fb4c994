"""CPU shim for `megatron.core.pipeline_parallel.p2p_communication`: p2p receive buffers live on torch.cuda.current_device() and batch_isend_irecv is followed by torch.cuda.synchronize()."""
from dcp_megatron.megatron.cpu_torch import CpuTorch
from patches import MEGATRON_CORE_VERSIONS
from patches.registry import Patch

CPU_PATCHES = (
    Patch(
        target="megatron.core.pipeline_parallel.p2p_communication:torch",
        replacement=CpuTorch(),
        reason="p2p receive buffers live on torch.cuda.current_device() and batch_isend_irecv is followed by torch.cuda.synchronize().",
        versions=MEGATRON_CORE_VERSIONS,
        # Only this module's view of torch changes; other modules keep the real one.
        rebind_aliases=False,
    ),
)
