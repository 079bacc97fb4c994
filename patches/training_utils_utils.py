"""CPU shim for `megatron.training.utils.utils` (no GPU only): its `torch` is a CPU view. reporting
helpers (memory, loss averaging across data-parallel ranks) allocate on CUDA.
"""
from patches.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

_REASON = ('reporting helpers (memory, loss averaging across data-parallel ranks) allocate on CUDA.')
_MODULE = "megatron.training.utils.utils"
CPU_PATCHES = (cpu_torch_patch(_MODULE, _REASON, MEGATRON_CORE_VERSIONS),)
