"""CPU shim for `megatron.core.transformer.moe.moe_utils` (no GPU only): its `torch` is a CPU view.

aux-loss tracking and token permutation utilities call `torch.cuda.current_stream()` and create tensors on the current CUDA device.
"""
from dcp_megatron.megatron.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

_REASON = "aux-loss tracking and token permutation utilities call `torch.cuda.current_stream()` and create tensors on the current CUDA device."
_MODULE = "megatron.core.transformer.moe.moe_utils"
CPU_PATCHES = (cpu_torch_patch(_MODULE, _REASON, MEGATRON_CORE_VERSIONS),)
