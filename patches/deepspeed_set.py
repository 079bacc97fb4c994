"""The patches a DeepSpeed run of a megatron-core model needs (no megatron.training ones).

- CPU shims (compat.py: its table and the modules' CPU_PATCHES), only on a machine without a GPU (they include our
  `PackedCoreAttention` as the local spec's core attention);
- transformer attention: RoPE of a packed micro-batch uses the micro-batch's CP group;
- multi-token prediction (a model with MTP layers): its shift and loss per document on the micro-batch's group;
- activation checkpoints: a checkpointed MLP's bias Parameter comes back as a copy (its replay recursed until
  the rank died; megatron's checkpoint, and TE's on GPU);
- Transformer Engine (GPU with TE only): a CP stream for per-micro-batch CP groups;
- DeepSpeed's comm backend: the groups it creates get the job's collective timeout, and its
  `deepspeed_shm_comm` op is not built (a stale build lock hung every later run);
- DeepSpeed's engine: a step abandoned inside `coalesce_grad_reduction` (a collective timed out) does not
  flush, which would wait one more timeout for the same stopped peer.
Megatron's training loop is not used under DeepSpeed, so its patches (arguments, schedule, get_batch)
are left out. Apply before `deepspeed.init_distributed` (the shared-memory op is built there).
"""
from __future__ import annotations

from datetime import timedelta

from patches.compat import cpu_compat_patches, needs_cpu_compat
from patches import (deepspeed_comm_torch, deepspeed_runtime_engine, extensions_transformer_engine,
                     tensor_parallel_random, transformer_attention,
                     transformer_multi_latent_attention, transformer_multi_token_prediction)
from patches.registry import PatchRegistry


def deepspeed_patch_registry(*, timeout: timedelta, installed_version: str | None = None) -> PatchRegistry:
    """`timeout`: the job's collective timeout (what `deepspeed.init_distributed` was given)."""
    patches = cpu_compat_patches() if needs_cpu_compat() else ()
    patches += (transformer_attention.dcp_patches() + transformer_multi_latent_attention.dcp_patches()
                + transformer_multi_token_prediction.dcp_patches()
                + extensions_transformer_engine.dcp_patches()
                + tensor_parallel_random.dcp_patches())
    patches += deepspeed_comm_torch.dcp_patches(timeout=timeout) + deepspeed_comm_torch.shm_comm_patches()
    patches += deepspeed_runtime_engine.dcp_patches()
    return PatchRegistry(patches, installed_version=installed_version)
