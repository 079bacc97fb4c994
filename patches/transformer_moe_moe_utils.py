"""CPU shim for `megatron.core.transformer.moe.moe_utils` (no GPU only): its `torch` is a CPU view.

aux-loss tracking and token permutation utilities call `torch.cuda.current_stream()` and create tensors on the current CUDA device.
"""
import torch

from patches.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS
from patches.registry import Patch

_REASON = "aux-loss tracking and token permutation utilities call `torch.cuda.current_stream()` and create tensors on the current CUDA device."
_MODULE = "megatron.core.transformer.moe.moe_utils"


def _host_copy(tensor, as_numpy: bool = False, record_stream: bool = False):
    """`maybe_move_tensor_to_cpu` for tensors already on the CPU: upstream converts only CUDA tensors to numpy,
    and the alltoall dispatcher's split sizes then reach `all_to_all_single` as tensors, which it refuses."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.detach().clone().numpy()
    return tensor


CPU_PATCHES = (cpu_torch_patch(_MODULE, _REASON, MEGATRON_CORE_VERSIONS),
               Patch(target=f"{_MODULE}:maybe_move_tensor_to_cpu", replacement=_host_copy,
                     reason="the alltoall dispatcher's split sizes are numpy arrays only when copied from CUDA; "
                            "on CPU they stay tensors and all_to_all_single refuses them (expert parallelism > 1).",
                     versions=MEGATRON_CORE_VERSIONS))
