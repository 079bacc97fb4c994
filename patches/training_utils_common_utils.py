"""CPU shim for `megatron.training.utils.common_utils`: model-parallel reductions of the update flag, loss and grad-norm helpers allocate on torch.cuda.current_device()."""
from dcp_megatron.megatron.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

CPU_PATCHES = (cpu_torch_patch("megatron.training.utils.common_utils", "model-parallel reductions of the update flag, loss and grad-norm helpers allocate on torch.cuda.current_device().", MEGATRON_CORE_VERSIONS),)
