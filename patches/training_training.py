"""CPU shim for `megatron.training.training`: tensors created with device='cuda' (start-up timestamps, loss sums, token counts), torch.cuda.synchronize/empty_cache and memory statistics in the loop."""
from dcp_megatron.megatron.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

CPU_PATCHES = (cpu_torch_patch("megatron.training.training", "tensors created with device='cuda' (start-up timestamps, loss sums, token counts), torch.cuda.synchronize/empty_cache and memory statistics in the loop.", MEGATRON_CORE_VERSIONS),)
