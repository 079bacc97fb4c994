"""GPU patches for `megatron.core.extensions.transformer_engine`: a CP stream for dynamic CP groups, and FP8's
checkpoint never handed a Parameter.

`TEDotProductAttention.forward` (0.19.2) hands TE the micro-batch's CP group when
`PackedSeqParams.cp_group` is set, passing the class attribute `cp_stream`; but that stream is created
in `__init__` only when the static `context_parallel_size > 1`. DCP runs Megatron with a static CP size
of 1 and supplies groups per micro-batch, so the stream would be None and TE's CP attention would fail.
TE keeps its default `cp_comm_type` ("p2p") because Megatron passes none for CP 1.

The replacement is a descriptor that creates the stream lazily, on the device that is current when the
stream is first asked for (TE runs its CP steps under `torch.cuda.stream(cp_stream)`, which also switches
the current device to the stream's: a stream made before Megatron's `torch.cuda.set_device` would put
every rank's CP kernels on GPU 0), one per device if a process ever uses several. Megatron's own
`if cp_stream is None: cp_stream = Stream()` then finds one and keeps it. Registered only on a machine
with a GPU and Transformer Engine; the descriptor itself is tested on CPU with a recording stream maker.

`te_checkpoint` (the MLP's recompute under FP8) gets the same fix as megatron's own checkpoint: the MLP returns its
bias Parameter through it, which would make the Parameter the checkpoint's output and its replay recurse
(patches/tensor_parallel_random.py says how).
"""
from __future__ import annotations

import importlib.util
from typing import Callable

import torch

import functools

from patches import MEGATRON_CORE_VERSIONS
from patches.registry import Patch
from patches.tensor_parallel_random import without_leaf_outputs

_TARGET = "megatron.core.extensions.transformer_engine:TEDotProductAttention.cp_stream"


class PerDeviceStream:
    """A class attribute whose value is a stream on the caller's current device, made when first read.

    A non-data descriptor on purpose: TE's `set_context_parallel_group` stores the stream it is handed
    on the instance (`self.cp_stream = cp_stream`), which must land in the instance's own dict."""

    def __init__(self, *, make_stream: Callable[[int], object] | None = None,
                 current_device: Callable[[], int] | None = None) -> None:
        self._make_stream = make_stream or (lambda device: torch.cuda.Stream(device=device))
        self._current_device = current_device or torch.cuda.current_device
        self._streams: dict[int, object] = {}

    def __get__(self, instance, owner=None):
        device = self._current_device()
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = self._make_stream(device)
        return stream



def te_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def _te_checkpoint_without_leaf_outputs(original):
    @functools.wraps(original)
    def te_checkpoint(forward_func, *args, **kwargs):
        return original(without_leaf_outputs(forward_func), *args, **kwargs)

    te_checkpoint.dcp_original = original
    return te_checkpoint


def dcp_patches() -> tuple[Patch, ...]:
    if not te_available():
        return ()
    from megatron.core.extensions import transformer_engine

    current = transformer_engine.te_checkpoint
    return (
        Patch(
            target="megatron.core.extensions.transformer_engine:te_checkpoint",
            replacement=_te_checkpoint_without_leaf_outputs(getattr(current, "dcp_original", current)),
            reason="the MLP returns its bias Parameter through the FP8 checkpoint, which makes the Parameter the "
                   "checkpoint's output and its replay recurse; the checkpointed function returns a copy instead.",
            versions=MEGATRON_CORE_VERSIONS,
        ),
        Patch(
            target=_TARGET,
            replacement=PerDeviceStream(),
            reason="cp_stream is created only for a static context_parallel_size > 1; dynamic groups need it "
                   "with a static CP size of 1, on the rank's own device (created at first use).",
            versions=MEGATRON_CORE_VERSIONS,
        ),
    )
