"""CPU shim for `megatron.core.tensor_parallel.mappings` (no GPU only): its `torch` is a CPU view.
sequence-parallel all-gather / reduce-scatter outputs are allocated on torch.cuda.current_device().
"""
from patches.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

_REASON = ('sequence-parallel all-gather / reduce-scatter outputs are allocated on '
           'torch.cuda.current_device().')
_MODULE = "megatron.core.tensor_parallel.mappings"
CPU_PATCHES = (cpu_torch_patch(_MODULE, _REASON, MEGATRON_CORE_VERSIONS),)
