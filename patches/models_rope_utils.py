"""CPU shim for `megatron.core.models.common.embeddings.rope_utils` (no GPU only): its `torch` is a CPU
view. With context parallelism, `get_pos_emb_on_this_cp_rank` builds its chunk indices on the CUDA
device.
"""
from patches.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

_REASON = "get_pos_emb_on_this_cp_rank (context parallelism) builds its chunk indices on the CUDA device."
_MODULE = "megatron.core.models.common.embeddings.rope_utils"
CPU_PATCHES = (cpu_torch_patch(_MODULE, _REASON, MEGATRON_CORE_VERSIONS),)
