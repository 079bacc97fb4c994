"""Patches for `megatron.core.tensor_parallel.random`.

CPU shim (no GPU only): the "CUDA" RNG becomes the CPU generator. Megatron keeps named CUDA RNG states
(data-parallel, tensor-parallel, expert) in a tracker, forks them for tensor-parallel regions, and saves/restores
them around activation recompute. On CPU the generator those regions actually draw from is the CPU one, so the
tracker and the checkpoint functions are pointed at it.

Every run (with or without --dcp): a checkpointed function never hands a Parameter back through the checkpoint.
megatron-core 0.19.2's MLP returns its output projection's bias Parameter itself (`skip_bias_add`), and
`TransformerLayer._forward_mlp` checkpoints the MLP under `recompute_mlp` (`--recompute-modules mlp`, and DCP's
per-micro-batch MLP relief). An autograd Function that returns a leaf tensor it was not given makes that leaf its
own output: the bias Parameter gets the checkpoint's backward as its `grad_fn` and stops being a leaf. The replay
in backward returns the same Parameter again, so `torch.autograd.backward` on it re-enters the checkpoint's
backward, which replays again: a model with linear biases (GPT-2-style GELU MLPs, megatron's default
`--add-bias-linear`) would recurse until the rank died at the first backward of an MLP-recomputed micro-batch. So
the checkpointed function returns a copy of such a leaf (a bias-sized copy; its gradient flows to the Parameter
through the copy, as the unrecomputed path's does through the bias add).
"""
from __future__ import annotations

import functools

import torch

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


def _copy_of_leaf(value):
    if isinstance(value, torch.Tensor) and value.is_leaf and value.requires_grad:
        return value.clone()
    return value


def without_leaf_outputs(function):
    """`function`, returning a copy of every output that is a leaf requiring grad (a Parameter), top level or in a
    returned tuple/list: what a checkpoint may return (module docstring)."""
    def run(*args, **kwargs):
        outputs = function(*args, **kwargs)
        if type(outputs) in (tuple, list):
            return type(outputs)(_copy_of_leaf(value) for value in outputs)
        return _copy_of_leaf(outputs)

    return run


def _checkpoint_without_leaf_outputs(original):
    @functools.wraps(original)
    def checkpoint(function, distribute_saved_activations, *args):
        return original(without_leaf_outputs(function), distribute_saved_activations, *args)

    checkpoint.dcp_original = original
    return checkpoint


def dcp_patches() -> tuple[Patch, ...]:
    from megatron.core.tensor_parallel import random

    return (Patch(target=f"{_MODULE}:checkpoint",
                  replacement=_checkpoint_without_leaf_outputs(getattr(random.checkpoint, "dcp_original",
                                                                       random.checkpoint)),
                  reason="the MLP returns its bias Parameter through the checkpoint (`recompute_mlp`), which makes "
                         "the Parameter the checkpoint's output and its replay recurse until the rank dies; the "
                         "checkpointed function returns a copy of such a leaf instead.",
                  versions=MEGATRON_CORE_VERSIONS),)


def _no_fp8_unless_asked(original_init):
    @functools.wraps(original_init)
    def __init__(self, fp8=False):
        original_init(self, fp8=fp8)
        self.fp8 = fp8 not in (None, False)
    return __init__


def checkpoint_without_output_patches() -> tuple[Patch, ...]:
    """Off Transformer Engine (tools/memcheck.py's meta stack): `CheckpointWithoutOutput()`, as transformer_layer.py
    builds it for `layernorm` recompute, sets `fp8 = fp8 is not None`, True for its default False, and its forward
    then reads Transformer Engine's FP8 state. False or None now mean no FP8, as they do under Transformer Engine
    outside FP8 autocast."""
    from megatron.core.tensor_parallel.random import CheckpointWithoutOutput

    return (Patch(target=f"{_MODULE}:CheckpointWithoutOutput.__init__",
                  replacement=_no_fp8_unless_asked(CheckpointWithoutOutput.__init__),
                  reason="CheckpointWithoutOutput() takes the FP8 path, which needs Transformer Engine.",
                  versions=MEGATRON_CORE_VERSIONS),)
