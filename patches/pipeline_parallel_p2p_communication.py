"""CPU shim for `megatron.core.pipeline_parallel.p2p_communication` (no GPU only): its `torch` is a CPU
view. p2p receive buffers live on torch.cuda.current_device() and batch_isend_irecv is followed by
torch.cuda.synchronize().
"""
from patches.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

_REASON = ('p2p receive buffers live on torch.cuda.current_device() and batch_isend_irecv is followed by '
           'torch.cuda.synchronize().')
_MODULE = "megatron.core.pipeline_parallel.p2p_communication"
CPU_PATCHES = (cpu_torch_patch(_MODULE, _REASON, MEGATRON_CORE_VERSIONS),)
