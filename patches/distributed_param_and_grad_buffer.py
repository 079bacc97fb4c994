"""CPU shim for `megatron.core.distributed.param_and_grad_buffer`: DDP's contiguous grad (and param) buffers are allocated on torch.cuda.current_device()."""
from dcp_megatron.megatron.cpu_torch import CpuTorch
from patches import MEGATRON_CORE_VERSIONS
from patches.registry import Patch

CPU_PATCHES = (
    Patch(
        target="megatron.core.distributed.param_and_grad_buffer:torch",
        replacement=CpuTorch(),
        reason="DDP's contiguous grad (and param) buffers are allocated on torch.cuda.current_device().",
        versions=MEGATRON_CORE_VERSIONS,
        # Only this module's view of torch changes; other modules keep the real one.
        rebind_aliases=False,
    ),
)
