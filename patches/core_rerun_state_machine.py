"""CPU shim for `megatron.core.rerun_state_machine`: saves and restores torch.cuda RNG state around every step (the CPU generator on a CPU run)."""
from dcp_megatron.megatron.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

CPU_PATCHES = (cpu_torch_patch("megatron.core.rerun_state_machine", "saves and restores torch.cuda RNG state around every step (the CPU generator on a CPU run).", MEGATRON_CORE_VERSIONS),)
