"""CPU shim for `megatron.core.transformer.utils` (no GPU only): its `torch` is a CPU view. the default
causal attention mask is built with device='cuda'.
"""
from patches.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

_REASON = ("the default causal attention mask is built with device='cuda'.")
_MODULE = "megatron.core.transformer.utils"
CPU_PATCHES = (cpu_torch_patch(_MODULE, _REASON, MEGATRON_CORE_VERSIONS),)
