"""CPU shim for `megatron.core.models.common.embeddings.rotary_pos_embedding`: RotaryEmbedding moves inv_freq to torch.cuda.current_device() on its first forward."""
from dcp_megatron.megatron.cpu_torch import CpuTorch
from patches import MEGATRON_CORE_VERSIONS
from patches.registry import Patch

CPU_PATCHES = (
    Patch(
        target="megatron.core.models.common.embeddings.rotary_pos_embedding:torch",
        replacement=CpuTorch(),
        reason="RotaryEmbedding moves inv_freq to torch.cuda.current_device() on its first forward.",
        versions=MEGATRON_CORE_VERSIONS,
        # Only this module's view of torch changes; other modules keep the real one.
        rebind_aliases=False,
    ),
)
