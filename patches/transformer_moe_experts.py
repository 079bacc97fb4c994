"""CPU shim for `megatron.core.transformer.moe.experts` (no GPU only): its `torch` is a CPU view.

expert MLPs place weights and token-count tensors on `torch.cuda.current_device()`.
"""
from patches.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

_REASON = "expert MLPs place weights and token-count tensors on `torch.cuda.current_device()`."
_MODULE = "megatron.core.transformer.moe.experts"
CPU_PATCHES = (cpu_torch_patch(_MODULE, _REASON, MEGATRON_CORE_VERSIONS),)
