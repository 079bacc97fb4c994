"""CPU shim for `megatron.core.dist_checkpointing.strategies.state_dict_saver`: the torch_dist save finalisation all-reduces its status on torch.cuda.current_device()."""
from dcp_megatron.megatron.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

CPU_PATCHES = (cpu_torch_patch("megatron.core.dist_checkpointing.strategies.state_dict_saver", "the torch_dist save finalisation all-reduces its status on torch.cuda.current_device().", MEGATRON_CORE_VERSIONS),)
