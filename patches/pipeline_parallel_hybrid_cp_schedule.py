"""CPU shim for `megatron.core.pipeline_parallel.hybrid_cp_schedule` (no GPU only): its `torch` is a
CPU view. Megatron's hybrid-CP schedule counts samples per group in tensors on CUDA.
"""
from patches.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

_REASON = "Megatron's hybrid-CP schedule counts samples per group in tensors on CUDA."
_MODULE = "megatron.core.pipeline_parallel.hybrid_cp_schedule"
CPU_PATCHES = (cpu_torch_patch(_MODULE, _REASON, MEGATRON_CORE_VERSIONS),)
