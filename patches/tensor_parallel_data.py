"""CPU shim for `megatron.core.tensor_parallel.data`: broadcast_data (tensor-parallel batch broadcast) allocates its buffers on torch.cuda.current_device()."""
from dcp_megatron.megatron.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

CPU_PATCHES = (cpu_torch_patch("megatron.core.tensor_parallel.data", "broadcast_data (tensor-parallel batch broadcast) allocates its buffers on torch.cuda.current_device().", MEGATRON_CORE_VERSIONS),)
