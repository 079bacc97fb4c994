"""Patches for `megatron.core.tensor_parallel.layers`.

CPU shim (no GPU only): its `torch` is a CPU view; sequence-parallel linear layers all-gather their input into a
buffer on torch.cuda.current_device() (forward and backward).

Every run (with or without --dcp): an expert's `RowParallelLinear` on a TP group of one without expert
parallelism (`--expert-model-parallel-size 1`, the local spec's SequentialMLP) takes Megatron's dense path,
`reduce_from_tensor_model_parallel_region`, whose autograd Function returns its input as-is on a group of one;
its output is then a view that autograd forbids modifying in place, and the expert MLP adds its bias in place
(`output += output_bias * per_token_scale`, transformer/mlp.py), so any MoE model with biases crashes at step 1
(e.g. the alltoall dispatcher at EP 1). Upstream's expert path (`explicit_expert_comm`: no reduction, the
matmul's own output, as at EP > 1 or TP > 1) is the same computation there — a group of one has nothing to
reduce, and its backward is the identity too — so such layers take it.
"""
from __future__ import annotations

import functools

from patches.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS
from patches.registry import Patch

_REASON = ('sequence-parallel linear layers all-gather their input into a buffer on '
           'torch.cuda.current_device() (forward and backward).')
_MODULE = "megatron.core.tensor_parallel.layers"
CPU_PATCHES = (cpu_torch_patch(_MODULE, _REASON, MEGATRON_CORE_VERSIONS),)


def _experts_skip_reduce_on_one_rank(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        from megatron.core.utils import get_pg_size

        # skip_bias_add: upstream's expert path asserts it (the MLP adds the bias itself)
        if self.is_expert and self.skip_bias_add and get_pg_size(self.tp_group) == 1:
            self.explicit_expert_comm = True

    __init__.dcp_original = original
    return __init__


def dcp_patches() -> tuple[Patch, ...]:
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    current = vars(RowParallelLinear)["__init__"]
    return (Patch(target=f"{_MODULE}:RowParallelLinear.__init__",
                  replacement=_experts_skip_reduce_on_one_rank(getattr(current, "dcp_original", current)),
                  reason="an expert's RowParallelLinear on a TP group of one returns the output of a no-op "
                         "all-reduce Function (a view) that the expert MLP then modifies in place (its bias, "
                         "transformer/mlp.py): EP 1 MoE with biases crashes; take upstream's expert path "
                         "(explicit_expert_comm), the same computation on a group of one.",
                  versions=MEGATRON_CORE_VERSIONS),)
