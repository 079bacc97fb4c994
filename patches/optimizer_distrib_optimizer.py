"""CPU shim for `megatron.core.optimizer.distrib_optimizer`: the distributed optimizer builds shard buffers and reductions with device=torch.cuda.current_device()."""
from dcp_megatron.megatron.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

CPU_PATCHES = (cpu_torch_patch("megatron.core.optimizer.distrib_optimizer", "the distributed optimizer builds shard buffers and reductions with device=torch.cuda.current_device().", MEGATRON_CORE_VERSIONS),)
