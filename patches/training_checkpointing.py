"""CPU shim for `megatron.training.checkpointing` (no GPU only): its `torch` is a CPU view. checkpoint
save/load moves RNG state and reductions through torch.cuda.
"""
from dcp_megatron.megatron.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

_REASON = ('checkpoint save/load moves RNG state and reductions through torch.cuda.')
_MODULE = "megatron.training.checkpointing"
CPU_PATCHES = (cpu_torch_patch(_MODULE, _REASON, MEGATRON_CORE_VERSIONS),)
