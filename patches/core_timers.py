"""CPU shim for `megatron.core.timers`: Timers allocate their all-gather buffers on torch.cuda.current_device() and synchronize CUDA."""
from dcp_megatron.megatron.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

CPU_PATCHES = (cpu_torch_patch("megatron.core.timers", "Timers allocate their all-gather buffers on torch.cuda.current_device() and synchronize CUDA.", MEGATRON_CORE_VERSIONS),)
