"""CPU shim for `megatron.training.models.dist_utils` (no GPU only): its `torch` is a CPU view. places
the model with module.cuda(torch.cuda.current_device()) and wraps DDP set-up in a side CUDA stream.
"""
from patches.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

_REASON = ('places the model with module.cuda(torch.cuda.current_device()) and wraps DDP set-up in a side '
           'CUDA stream.')
_MODULE = "megatron.training.models.dist_utils"
CPU_PATCHES = (cpu_torch_patch(_MODULE, _REASON, MEGATRON_CORE_VERSIONS),)
