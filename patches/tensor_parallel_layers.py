"""CPU shim for `megatron.core.tensor_parallel.layers` (no GPU only): its `torch` is a CPU view.
sequence-parallel linear layers all-gather their input into a buffer on torch.cuda.current_device()
(forward and backward).
"""
from dcp_megatron.megatron.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

_REASON = ('sequence-parallel linear layers all-gather their input into a buffer on '
           'torch.cuda.current_device() (forward and backward).')
_MODULE = "megatron.core.tensor_parallel.layers"
CPU_PATCHES = (cpu_torch_patch(_MODULE, _REASON, MEGATRON_CORE_VERSIONS),)
