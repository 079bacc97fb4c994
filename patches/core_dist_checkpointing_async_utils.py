"""CPU shim for `megatron.core.dist_checkpointing.strategies.async_utils` (no GPU only): its `torch` is
a CPU view. async checkpoint workers check liveness with tensors on torch.cuda.current_device() and
synchronize CUDA.
"""
from patches.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

_REASON = ('async checkpoint workers check liveness with tensors on torch.cuda.current_device() and '
           'synchronize CUDA.')
_MODULE = "megatron.core.dist_checkpointing.strategies.async_utils"
CPU_PATCHES = (cpu_torch_patch(_MODULE, _REASON, MEGATRON_CORE_VERSIONS),)
