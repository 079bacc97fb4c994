"""CPU shim for `megatron.core.transformer.moe.token_dispatcher` (no GPU only): its `torch` is a CPU view.

the alltoall dispatcher creates a `torch.cuda.Stream()` at construction and moves token counts with `.to(torch.device('cuda'))`/`.cuda()`; MoE on CPU fails at model build.
"""
from patches.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

_REASON = "the alltoall dispatcher creates a `torch.cuda.Stream()` at construction and moves token counts with `.to(torch.device('cuda'))`/`.cuda()`; MoE on CPU fails at model build."
_MODULE = "megatron.core.transformer.moe.token_dispatcher"
CPU_PATCHES = (cpu_torch_patch(_MODULE, _REASON, MEGATRON_CORE_VERSIONS),)
