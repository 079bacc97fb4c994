"""CPU shim for `megatron.core.models.backends`: the local spec's core attention takes packed input.

megatron-core's local `DotProductAttention` (what `--transformer-impl local` builds, the only
implementation without Transformer Engine) asserts on `PackedSeqParams` and on CP > 1, so a script
that trains on documents separated by `cu_seqlens` (`--dataloader-inter-document-masking`) cannot
run on CPU at all. `LocalSpecProvider.core_attention` is the one place every local layer spec asks
for its core attention; on a machine without a GPU it answers with our `PackedCoreAttention`
(per-document causal attention, any CP group), which also handles the default `sbhd` layout.
"""
from __future__ import annotations

from patches import MEGATRON_CORE_VERSIONS
from patches.registry import Patch


def _packed_core_attention(self) -> type:
    from dcp_megatron.core.core_attention import PackedCoreAttention

    return PackedCoreAttention


CPU_PATCHES = (
    Patch(target="megatron.core.models.backends:LocalSpecProvider.core_attention",
          replacement=_packed_core_attention,
          reason="the local DotProductAttention refuses packed (THD) input and CP groups.",
          versions=MEGATRON_CORE_VERSIONS),
)
