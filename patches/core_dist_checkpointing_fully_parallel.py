"""CPU shim for `megatron.core.dist_checkpointing.strategies.fully_parallel`: the fully parallel save/load wrapper calls torch.cuda.synchronize()."""
from dcp_megatron.megatron.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

CPU_PATCHES = (cpu_torch_patch("megatron.core.dist_checkpointing.strategies.fully_parallel", "the fully parallel save/load wrapper calls torch.cuda.synchronize().", MEGATRON_CORE_VERSIONS),)
