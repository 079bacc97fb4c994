"""Patch for `megatron.core.transformer.torch_norm`: sequence parallelism with torch's norms (local spec).

Megatron's local layer spec (the one a CPU run builds: no Transformer Engine) normalises with
`WrappedTorchNorm`, which asserts `not config.sequence_parallel`. Under sequence parallelism a norm
sees only its TP rank's slice of the sequence, so its weight gradient is a partial sum; Transformer
Engine's norms mark their parameters `sequence_parallel`, and Megatron's `finalize_model_grads`
all-reduces exactly those gradients over the TP group. This patch builds the same torch norm and
marks its parameters the same way, so `--sequence-parallel` trains exactly on CPU. Without
`--sequence-parallel` the upstream constructor runs unchanged.
"""
from __future__ import annotations

import importlib

from patches import MEGATRON_CORE_VERSIONS
from patches.registry import Patch

_MODULE = "megatron.core.transformer.torch_norm"


def _with_sequence_parallel(original_new):
    def __new__(cls, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, *args, **kwargs)
        # The config object is shared by every module: hide SP only while this norm is built.
        config.sequence_parallel = False
        try:
            norm = original_new(cls, config, hidden_size, *args, **kwargs)
        finally:
            config.sequence_parallel = True
        for param in norm.parameters():
            param.sequence_parallel = True  # finalize_model_grads sums these gradients over TP
        return norm

    __new__.dcp_original = original_new
    return staticmethod(__new__)


def cpu_patches() -> tuple[Patch, ...]:
    module = importlib.import_module(_MODULE)
    current = vars(module.WrappedTorchNorm)["__new__"]
    function = current.__func__ if isinstance(current, staticmethod) else current
    original = getattr(function, "dcp_original", function)
    return (
        Patch(target=f"{_MODULE}:WrappedTorchNorm.__new__", replacement=_with_sequence_parallel(original),
              reason="asserts no --sequence-parallel; builds the norm with its parameters marked "
                     "sequence_parallel so finalize_model_grads sums their gradients over TP, as TE's norms do.",
              versions=MEGATRON_CORE_VERSIONS),
    )
