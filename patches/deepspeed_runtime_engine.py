"""Patch for `deepspeed.runtime.engine`: an abandoned step does not flush its coalesced gradient reduction.

`DeepSpeedEngine.coalesce_grad_reduction()` (DeepSpeed 0.19.8; DCP's ZeRO-1/2 steps run every micro-batch
inside it, so the step reduces its gradients once) flushes the reduction in a `finally`, that is also when
the block raised. When the block raised because a collective timed out (a peer stopped or died), that flush
is one more collective with the same peer: it waits a second full --distributed-timeout-minutes before the
run can stop and say which rank stopped (measured: 49 s instead of 27 s at a 21 s timeout). The step is
abandoned either way (its gradients are never applied; the training script stops). The replacement runs
DeepSpeed's own exit (its flags reset) with the flush skipped when the block raised; a block that ends
normally is DeepSpeed's, unchanged.
"""
from __future__ import annotations

import contextlib
import functools

from patches import DEEPSPEED_VERSIONS
from patches.registry import Patch

_TARGET = "deepspeed.runtime.engine:DeepSpeedEngine.coalesce_grad_reduction"
_FLUSHES = ("_flush_coalesced_reduction_zero12", "_flush_coalesced_reduction_zero3")


def _skip_flush_on_error(original):
    @functools.wraps(original)
    @contextlib.contextmanager
    def coalesce_grad_reduction(self):
        scope = original(self)
        scope.__enter__()
        try:
            yield
        except BaseException as err:
            # Instance attributes shadow the engine's flush methods for this one exit only.
            for name in _FLUSHES:
                setattr(self, name, lambda optimizer: None)
            try:
                scope.__exit__(type(err), err, err.__traceback__)
            finally:
                for name in _FLUSHES:
                    delattr(self, name)
            raise
        scope.__exit__(None, None, None)

    coalesce_grad_reduction.dcp_original = original
    return coalesce_grad_reduction


def dcp_patches() -> tuple[Patch, ...]:
    from deepspeed.runtime.engine import DeepSpeedEngine

    original = vars(DeepSpeedEngine)["coalesce_grad_reduction"]
    original = getattr(original, "dcp_original", original)
    return (
        Patch(
            target=_TARGET,
            replacement=_skip_flush_on_error(original),
            reason="its flush runs in a finally: after a collective timed out inside the block it waits a second "
                   "full timeout for the same stopped peer before the run can stop.",
            versions=DEEPSPEED_VERSIONS,
            distribution="deepspeed",
        ),
    )
