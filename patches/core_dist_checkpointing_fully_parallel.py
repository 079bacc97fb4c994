"""CPU shim for `megatron.core.dist_checkpointing.strategies.fully_parallel` (no GPU only): its `torch`
is a CPU view. the fully parallel save/load wrapper calls torch.cuda.synchronize().
"""
from patches.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

_REASON = ('the fully parallel save/load wrapper calls torch.cuda.synchronize().')
_MODULE = "megatron.core.dist_checkpointing.strategies.fully_parallel"
CPU_PATCHES = (cpu_torch_patch(_MODULE, _REASON, MEGATRON_CORE_VERSIONS),)
