"""CPU shim for `megatron.training.checkpointing`: checkpoint save/load moves RNG state and reductions through torch.cuda."""
from dcp_megatron.megatron.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

CPU_PATCHES = (cpu_torch_patch("megatron.training.checkpointing", "checkpoint save/load moves RNG state and reductions through torch.cuda.", MEGATRON_CORE_VERSIONS),)
