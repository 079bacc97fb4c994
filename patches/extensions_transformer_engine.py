"""GPU patch for `megatron.core.extensions.transformer_engine`: a CP stream for dynamic CP groups.

`TEDotProductAttention.forward` (0.16.1) switches TE's context-parallel group per micro-batch
when `PackedSeqParams.cp_group` is set, passing the class attribute `cp_stream`; but that stream
is created in `__init__` only when the static `context_parallel_size > 1`. DCP runs Megatron
with a static CP size of 1 and supplies groups per micro-batch, so the stream would be None
and TE's CP attention would fail. The patch gives the class a stream up front (fixed upstream
later). TE keeps its default `cp_comm_type` ("p2p") because Megatron passes none for CP 1.
Only registered on a machine with a GPU and Transformer Engine. The stream is created when
`dcp_patches()` is called, on the current CUDA device: call it after `torch.cuda.set_device`
(otherwise every rank's CP stream would live on GPU 0, not on the GPU its attention runs on).
"""
from __future__ import annotations

import importlib.util

import torch

from patches import MEGATRON_CORE_VERSIONS
from patches.registry import Patch

_TARGET = "megatron.core.extensions.transformer_engine:TEDotProductAttention.cp_stream"


def te_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def dcp_patches() -> tuple[Patch, ...]:
    if not te_available():
        return ()
    return (
        Patch(
            target=_TARGET,
            replacement=torch.cuda.Stream(),
            reason="cp_stream is created only for a static context_parallel_size > 1; dynamic groups need it "
                   "with a static CP size of 1.",
            versions=MEGATRON_CORE_VERSIONS,
        ),
    )
