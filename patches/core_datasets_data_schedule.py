"""CPU shim for `megatron.core.datasets.data_schedule` (no GPU only): its `torch` is a CPU view.
Megatron's hybrid-CP data wrapper exchanges samples through buffers on torch.cuda.current_device().
"""
from patches.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

_REASON = ("Megatron's hybrid-CP data wrapper exchanges samples through buffers on "
           'torch.cuda.current_device().')
_MODULE = "megatron.core.datasets.data_schedule"
CPU_PATCHES = (cpu_torch_patch(_MODULE, _REASON, MEGATRON_CORE_VERSIONS),)
