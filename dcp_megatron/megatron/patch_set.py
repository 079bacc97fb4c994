"""All patches pretrain_gpt.py applies to megatron-core, as one registry (apply once, remove at exit).

- CPU shims (patches/ CPU_PATCHES, via compat), only on a machine without a GPU;
- transformer attention: RoPE of a packed micro-batch uses the micro-batch's CP group;
- Transformer Engine (GPU with TE only): a CP stream for dynamic CP groups.
"""
from __future__ import annotations

from dcp_megatron.megatron.compat import cpu_compat_patches, needs_cpu_compat
from patches import extensions_transformer_engine, transformer_attention
from patches.registry import PatchRegistry


def megatron_patch_registry(*, installed_version: str | None = None) -> PatchRegistry:
    patches = cpu_compat_patches() if needs_cpu_compat() else ()
    patches += transformer_attention.dcp_patches() + extensions_transformer_engine.dcp_patches()
    return PatchRegistry(patches, installed_version=installed_version)
