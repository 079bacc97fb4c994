"""CPU shim for `megatron.core.transformer.moe.moe_layer` (no GPU only): its `torch` is a CPU view.

the MoE layer's optional streams and events (`torch.cuda.Stream`, `torch.cuda.current_stream`) for overlapped shared experts and delayed weight gradients.
"""
from patches.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

_REASON = "the MoE layer's optional streams and events (`torch.cuda.Stream`, `torch.cuda.current_stream`) for overlapped shared experts and delayed weight gradients."
_MODULE = "megatron.core.transformer.moe.moe_layer"
CPU_PATCHES = (cpu_torch_patch(_MODULE, _REASON, MEGATRON_CORE_VERSIONS),)
