"""CPU shim for `megatron.core.dist_checkpointing.strategies.state_dict_saver` (no GPU only): its
`torch` is a CPU view. the torch_dist save finalisation all-reduces its status on
torch.cuda.current_device().
"""
from patches.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

_REASON = ('the torch_dist save finalisation all-reduces its status on torch.cuda.current_device().')
_MODULE = "megatron.core.dist_checkpointing.strategies.state_dict_saver"
CPU_PATCHES = (cpu_torch_patch(_MODULE, _REASON, MEGATRON_CORE_VERSIONS),)
