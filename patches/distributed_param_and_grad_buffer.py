"""CPU shim for `megatron.core.distributed.param_and_grad_buffer` (no GPU only): its `torch` is a CPU
view. DDP's contiguous grad (and param) buffers are allocated on torch.cuda.current_device().
"""
from patches.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

_REASON = ("DDP's contiguous grad (and param) buffers are allocated on torch.cuda.current_device().")
_MODULE = "megatron.core.distributed.param_and_grad_buffer"
CPU_PATCHES = (cpu_torch_patch(_MODULE, _REASON, MEGATRON_CORE_VERSIONS),)
