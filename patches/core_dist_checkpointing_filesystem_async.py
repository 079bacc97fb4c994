"""CPU shim for `megatron.core.dist_checkpointing.strategies.filesystem_async` (no GPU only): its
`torch` is a CPU view. the torch_dist checkpoint writer stages tensors through torch.cuda streams
and pinned memory.
"""
from dcp_megatron.megatron.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

_REASON = ('the torch_dist checkpoint writer stages tensors through torch.cuda streams and pinned memory.')
_MODULE = "megatron.core.dist_checkpointing.strategies.filesystem_async"
CPU_PATCHES = (cpu_torch_patch(_MODULE, _REASON, MEGATRON_CORE_VERSIONS),)
