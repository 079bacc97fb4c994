"""CPU shim for `megatron.training.models.dist_utils`: places the model with module.cuda(torch.cuda.current_device()) and wraps DDP set-up in a side CUDA stream."""
from dcp_megatron.megatron.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

CPU_PATCHES = (cpu_torch_patch("megatron.training.models.dist_utils", "places the model with module.cuda(torch.cuda.current_device()) and wraps DDP set-up in a side CUDA stream.", MEGATRON_CORE_VERSIONS),)
