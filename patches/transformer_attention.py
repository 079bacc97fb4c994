"""Patch for `megatron.core.transformer.attention`: RoPE of a packed micro-batch uses its own CP group.

megatron-core 0.16.1 applies rotary embeddings to packed (THD) query/key rows with
`cp_group=self.pg_collection.cp`, the static context-parallel group fixed at construction.
Under DCP every micro-batch may run on a different group (size 1, 2, 4, ...), carried by
`PackedSeqParams.cp_group` (the upstream seam for per-micro-batch CP groups, which TE's
attention already reads). The zig-zag layout Megatron's THD RoPE assumes is exactly ours, so
the only change needed is the group: for the duration of one `Attention.forward` whose
packed_seq_params names a group, the module sees that group as its `cp` group. Nothing else in
`Attention.forward` reads `pg_collection.cp`. The swap is local to the call (restored in
`finally`) and is replayed by recompute, which calls forward again with the same params.
A micro-batch without a group (CP size 1) keeps the static group, which DCP sets up with size 1.
"""
from __future__ import annotations

import copy
import functools

from patches import MEGATRON_CORE_VERSIONS
from patches.registry import Patch

_TARGET = "megatron.core.transformer.attention:Attention.forward"


def _with_microbatch_cp_group(original_forward):
    @functools.wraps(original_forward)
    def forward(self, hidden_states, *args, **kwargs):
        packed_seq_params = kwargs.get("packed_seq_params")
        group = getattr(packed_seq_params, "cp_group", None)
        if group is None:
            return original_forward(self, hidden_states, *args, **kwargs)
        static_groups = self.pg_collection
        microbatch_groups = copy.copy(static_groups)
        microbatch_groups.cp = group
        self.pg_collection = microbatch_groups
        try:
            return original_forward(self, hidden_states, *args, **kwargs)
        finally:
            self.pg_collection = static_groups

    forward.dcp_original = original_forward
    return forward


def dcp_patches() -> tuple[Patch, ...]:
    from megatron.core.transformer.attention import Attention

    original = vars(Attention)["forward"]
    original = getattr(original, "dcp_original", original)
    return (
        Patch(
            target=_TARGET,
            replacement=_with_microbatch_cp_group(original),
            reason="RoPE of packed rows reads the static CP group; DCP micro-batches carry their own group in "
                   "PackedSeqParams.cp_group.",
            versions=MEGATRON_CORE_VERSIONS,
        ),
    )
