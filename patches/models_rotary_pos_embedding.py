"""CPU shim for `megatron.core.models.common.embeddings.rotary_pos_embedding` (no GPU only): its
`torch` is a CPU view. RotaryEmbedding moves inv_freq to torch.cuda.current_device() on its first
forward.
"""
from patches.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

_REASON = ('RotaryEmbedding moves inv_freq to torch.cuda.current_device() on its first forward.')
_MODULE = "megatron.core.models.common.embeddings.rotary_pos_embedding"
CPU_PATCHES = (cpu_torch_patch(_MODULE, _REASON, MEGATRON_CORE_VERSIONS),)
