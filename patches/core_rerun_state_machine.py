"""CPU shim for `megatron.core.rerun_state_machine` (no GPU only): its `torch` is a CPU view. saves and
restores torch.cuda RNG state around every step (the CPU generator on a CPU run).
"""
from patches.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS

_REASON = ('saves and restores torch.cuda RNG state around every step (the CPU generator on a CPU run).')
_MODULE = "megatron.core.rerun_state_machine"
CPU_PATCHES = (cpu_torch_patch(_MODULE, _REASON, MEGATRON_CORE_VERSIONS),)
