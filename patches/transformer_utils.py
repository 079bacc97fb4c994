"""CPU shim for `megatron.core.transformer.utils`: the default causal attention mask is built with device='cuda'."""
from dcp_megatron.megatron.cpu_torch import CpuTorch
from patches import MEGATRON_CORE_VERSIONS
from patches.registry import Patch

CPU_PATCHES = (
    Patch(
        target="megatron.core.transformer.utils:torch",
        replacement=CpuTorch(),
        reason="the default causal attention mask is built with device='cuda'.",
        versions=MEGATRON_CORE_VERSIONS,
        # Only this module's view of torch changes; other modules keep the real one.
        rebind_aliases=False,
    ),
)
