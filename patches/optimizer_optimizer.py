"""CPU shim for `megatron.core.optimizer.optimizer` (no GPU only): its `torch` is a CPU view.
FP32Optimizer and the chained optimizer create their loss-scale tensors with device='cuda'.
"""
from patches.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

_REASON = ("FP32Optimizer and the chained optimizer create their loss-scale tensors with device='cuda'.")
_MODULE = "megatron.core.optimizer.optimizer"
CPU_PATCHES = (cpu_torch_patch(_MODULE, _REASON, MEGATRON_CORE_VERSIONS),)
