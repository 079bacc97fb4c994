"""CPU shim for `megatron.core.tensor_parallel.data` (no GPU only): its `torch` is a CPU view.
broadcast_data (tensor-parallel batch broadcast) allocates its buffers on
torch.cuda.current_device().
"""
from patches.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

_REASON = ('broadcast_data (tensor-parallel batch broadcast) allocates its buffers on '
           'torch.cuda.current_device().')
_MODULE = "megatron.core.tensor_parallel.data"
CPU_PATCHES = (cpu_torch_patch(_MODULE, _REASON, MEGATRON_CORE_VERSIONS),)
