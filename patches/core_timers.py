"""CPU shim for `megatron.core.timers` (no GPU only): its `torch` is a CPU view. Timers allocate their
all-gather buffers on torch.cuda.current_device() and synchronize CUDA.
"""
from patches.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

_REASON = ('Timers allocate their all-gather buffers on torch.cuda.current_device() and synchronize CUDA.')
_MODULE = "megatron.core.timers"
CPU_PATCHES = (cpu_torch_patch(_MODULE, _REASON, MEGATRON_CORE_VERSIONS),)
