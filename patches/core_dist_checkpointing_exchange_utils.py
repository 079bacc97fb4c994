"""CPU shim for `megatron.core.dist_checkpointing.exchange_utils`: checkpoint shard exchange allocates its receive buffers with device='cuda'."""
from dcp_megatron.megatron.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

CPU_PATCHES = (cpu_torch_patch("megatron.core.dist_checkpointing.exchange_utils", "checkpoint shard exchange allocates its receive buffers with device='cuda'.", MEGATRON_CORE_VERSIONS),)
