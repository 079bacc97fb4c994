"""CPU shim for `megatron.core.tensor_parallel.random`: the "CUDA" RNG becomes the CPU generator.

Megatron keeps named CUDA RNG states (data-parallel, tensor-parallel, expert) in a tracker,
forks them for tensor-parallel regions, and saves/restores them around activation
recompute. On CPU the generator those regions actually draw from is the CPU one, so the
tracker and the checkpoint functions are pointed at it.
"""
from patches.cpu_torch import CpuTorch, get_cpu_rng_state, set_cpu_rng_state
from patches import MEGATRON_CORE_VERSIONS
from patches.registry import Patch

_MODULE = "megatron.core.tensor_parallel.random"

CPU_PATCHES = (
    Patch(
        target=f"{_MODULE}:torch",
        replacement=CpuTorch(),
        reason="CudaRNGStatesTracker.add and model_parallel_cuda_manual_seed call torch.cuda RNG functions.",
        versions=MEGATRON_CORE_VERSIONS,
        rebind_aliases=False,
    ),
    Patch(
        target=f"{_MODULE}:_get_cuda_rng_state",
        replacement=get_cpu_rng_state,
        reason="reads torch.cuda.default_generators, which a CPU build does not have.",
        versions=MEGATRON_CORE_VERSIONS,
    ),
    Patch(
        target=f"{_MODULE}:_set_cuda_rng_state",
        replacement=set_cpu_rng_state,
        reason="writes torch.cuda.default_generators, which a CPU build does not have.",
        versions=MEGATRON_CORE_VERSIONS,
    ),
)
