"""CPU shim for `megatron.core.dist_checkpointing.exchange_utils` (no GPU only): its `torch` is a CPU
view. checkpoint shard exchange allocates its receive buffers with device='cuda'.
"""
from patches.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

_REASON = ("checkpoint shard exchange allocates its receive buffers with device='cuda'.")
_MODULE = "megatron.core.dist_checkpointing.exchange_utils"
CPU_PATCHES = (cpu_torch_patch(_MODULE, _REASON, MEGATRON_CORE_VERSIONS),)
