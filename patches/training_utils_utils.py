"""CPU shim for `megatron.training.utils.utils`: reporting helpers (memory, loss averaging across data-parallel ranks) allocate on CUDA."""
from dcp_megatron.megatron.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

CPU_PATCHES = (cpu_torch_patch("megatron.training.utils.utils", "reporting helpers (memory, loss averaging across data-parallel ranks) allocate on CUDA.", MEGATRON_CORE_VERSIONS),)
