"""CPU shim for `megatron.training.utils.common_utils` (no GPU only): its `torch` is a CPU view. model-
parallel reductions of the update flag, loss and grad-norm helpers allocate on
torch.cuda.current_device().
"""
from patches.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

_REASON = ('model-parallel reductions of the update flag, loss and grad-norm helpers allocate on '
           'torch.cuda.current_device().')
_MODULE = "megatron.training.utils.common_utils"
CPU_PATCHES = (cpu_torch_patch(_MODULE, _REASON, MEGATRON_CORE_VERSIONS),)
