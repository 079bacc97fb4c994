"""CPU shim for `megatron.core.dist_checkpointing.strategies.async_utils`: async checkpoint workers check liveness with tensors on torch.cuda.current_device() and synchronize CUDA."""
from dcp_megatron.megatron.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

CPU_PATCHES = (cpu_torch_patch("megatron.core.dist_checkpointing.strategies.async_utils", "async checkpoint workers check liveness with tensors on torch.cuda.current_device() and synchronize CUDA.", MEGATRON_CORE_VERSIONS),)
