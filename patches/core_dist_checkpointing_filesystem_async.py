"""CPU shim for `megatron.core.dist_checkpointing.strategies.filesystem_async`: the torch_dist checkpoint writer stages tensors through torch.cuda streams and pinned memory."""
from dcp_megatron.megatron.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

CPU_PATCHES = (cpu_torch_patch("megatron.core.dist_checkpointing.strategies.filesystem_async", "the torch_dist checkpoint writer stages tensors through torch.cuda streams and pinned memory.", MEGATRON_CORE_VERSIONS),)
