"""CPU shim for `megatron.core.pipeline_parallel.schedules` (no GPU only): its `torch` is a CPU view.
the schedules create total_num_tokens with device='cuda'.
"""
from patches.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

_REASON = ("the schedules create total_num_tokens with device='cuda'.")
_MODULE = "megatron.core.pipeline_parallel.schedules"
CPU_PATCHES = (cpu_torch_patch(_MODULE, _REASON, MEGATRON_CORE_VERSIONS),)
