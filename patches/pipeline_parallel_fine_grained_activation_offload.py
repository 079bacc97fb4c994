"""Patch for `megatron.core.pipeline_parallel.fine_grained_activation_offload`: under DCP every training step is
its own offload warm-up, and offloaded tensors take pinned memory from torch's caching host allocator.

megatron-core 0.19.2's `PipelineOffloadManager` (a singleton) learns a step's layout in its first step (the
warm-up): one `ChunkOffloadHandler` per model-chunk forward, each with the offload groups its forward opened, in
order. The schedule's `reset()` at the end of that step freezes the layout (`post_warmup_callback`, which also
all-gathers and prints a summary table), and every later step replays it: `init_model_chunk_offload_handler`
returns early, and forwards and backwards walk the cached handlers by group name. A DCP step has its own
micro-batch count and, per micro-batch, its own offload set (dcp_megatron/core/offload.py), so a frozen layout
would hand a micro-batch another one's handler. With the manager marked by DCP (`DCP_STEPS_ATTR`, set by
`own_warmup_every_step` before a DCP step), `reset()` drops the step's handlers and stays in warm-up: the next
step records its own. The warm-up path offloads every group it opens (upstream's margin, PP balancing and
`activation_offload_fraction` tuning, computed from a frozen layout, do not apply: offload_checks refuses them).

Upstream keeps a pinned CPU pool per (shape, dtype) for the attention groups and never frees it (CUDA graphs
need stable addresses; its MoE groups already skip the pool). DCP's micro-batches have new shapes every step: the
pool would grow without bound. In DCP's mode every group skips the pool, as upstream's MoE groups do.

A manager without the mark (every non-DCP run) behaves as upstream.
"""
from __future__ import annotations

import functools

from patches import MEGATRON_CORE_VERSIONS
from patches.registry import Patch

_MODULE = "megatron.core.pipeline_parallel.fine_grained_activation_offload"


def _in_dcp_mode(manager) -> bool:
    from dcp_megatron.core.offload import DCP_STEPS_ATTR

    return bool(getattr(manager, DCP_STEPS_ATTR, False))


def _every_step_its_own_warmup(original):
    @functools.wraps(original)
    def reset(self):
        if _in_dcp_mode(self):
            # the step's handlers go (nothing else holds them once its backward ran); warm-up again
            self._cached_chunks_forward = []
            self._cached_chunks_backward = []
            self._queue.clear()
            self._stages = None
            self._is_warmup = True
        return original(self)

    reset.dcp_original = original
    return reset


def _no_shape_pool_under_dcp(original):
    @functools.wraps(original)
    def __init__(self, name):
        original(self, name)
        from megatron.core.pipeline_parallel.fine_grained_activation_offload import PipelineOffloadManager

        if _in_dcp_mode(PipelineOffloadManager.OFFLOAD_MGR):
            self.use_cpu_pool = False

    __init__.dcp_original = original
    return __init__


def dcp_patches() -> tuple[Patch, ...]:
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as upstream

    def unwrapped(owner, name: str):
        current = vars(owner)[name]
        return getattr(current, "dcp_original", current)

    return (
        Patch(target=f"{_MODULE}:PipelineOffloadManager.reset",
              replacement=_every_step_its_own_warmup(unwrapped(upstream.PipelineOffloadManager, "reset")),
              reason="the manager freezes the first step's layout of offload groups; a DCP step has its own "
                     "micro-batches and offload sets, so every DCP step is its own warm-up.",
              versions=MEGATRON_CORE_VERSIONS),
        Patch(target=f"{_MODULE}:OffloadTensorGroup.__init__",
              replacement=_no_shape_pool_under_dcp(unwrapped(upstream.OffloadTensorGroup, "__init__")),
              reason="the pinned pool keeps a buffer per tensor shape forever; DCP's shapes change every step.",
              versions=MEGATRON_CORE_VERSIONS),
    )
