"""CPU shim for `megatron.core.transformer.moe.router` (no GPU only): its `torch` is a CPU view.

the router moves its weight to `torch.cuda.current_device()` and creates its aux-loss/statistics buffers there.
"""
from dcp_megatron.megatron.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

_REASON = "the router moves its weight to `torch.cuda.current_device()` and creates its aux-loss/statistics buffers there."
_MODULE = "megatron.core.transformer.moe.router"
CPU_PATCHES = (cpu_torch_patch(_MODULE, _REASON, MEGATRON_CORE_VERSIONS),)
