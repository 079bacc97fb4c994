"""The megatron-core patches a DeepSpeed run of a megatron-core model needs (no megatron.training ones).

- CPU shims (patches/ CPU_PATCHES via compat), only on a machine without a GPU (they include our
  `PackedCoreAttention` as the local spec's core attention);
- transformer attention: RoPE of a packed micro-batch uses the micro-batch's CP group;
- Transformer Engine (GPU with TE only): a CP stream for per-micro-batch CP groups.
Megatron's training loop is not used under DeepSpeed, so its patches (arguments, schedule, get_batch)
are left out. Apply after `torch.cuda.set_device` (the TE stream is created on the current device).
"""
from __future__ import annotations

from dcp_megatron.megatron.compat import cpu_compat_patches, needs_cpu_compat
from patches import extensions_transformer_engine, transformer_attention
from patches.registry import PatchRegistry


def deepspeed_patch_registry(*, installed_version: str | None = None) -> PatchRegistry:
    patches = cpu_compat_patches() if needs_cpu_compat() else ()
    patches += transformer_attention.dcp_patches() + extensions_transformer_engine.dcp_patches()
    return PatchRegistry(patches, installed_version=installed_version)
