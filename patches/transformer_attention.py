"""Patch for `megatron.core.transformer.attention`: a DCP micro-batch's attention uses its own CP group for RoPE
and its own selective-recompute choice, also when full recompute replays it later.

megatron-core 0.19.2 applies rotary embeddings to packed (THD) query/key rows with
`cp_group=self.pg_collection.cp`, the static context-parallel group fixed at construction.
Under DCP every micro-batch may run on a different group (size 1, 2, 4, ...), carried by
`PackedSeqParams.cp_group` (the upstream seam for per-micro-batch CP groups, which TE's
attention already reads). The zig-zag layout Megatron's THD RoPE assumes is exactly ours, so
the only change needed is the group: for the duration of one `Attention.forward` whose
packed_seq_params names a group, the module sees that group as its `cp` group. Nothing else in
`Attention.forward` reads `pg_collection.cp`. The swap is local to the call (restored in
`finally`) and is replayed by recompute, which calls forward again with the same params.
A micro-batch without a group (CP size 1) keeps the static group, which DCP sets up with size 1.

Selective recompute (`Attention.checkpoint_core_attention`) is a module attribute that DCP sets before each
micro-batch's forward (dcp_megatron/core/recompute.py). Full recompute replays a layer's forward in backward
and reads the attribute then: under pipeline parallelism (1F1B runs later micro-batches' forwards before earlier
ones' backwards) it holds the *latest* micro-batch's choice. Two ranks of a CP group whose latest micro-batches
differ (CP-1 micro-batches of their own) would then replay the same CP micro-batch differently, one checkpointing
core attention again (an extra all-gather in backward), and wait on each other forever (seen: PP 4 x VPP 2 on a
2-rank domain). So a DCP micro-batch's choice is read from the facts its PackedSeqParams carry (`facts_of`,
dcp_megatron/core/microbatch_facts.py: "core_attn" in its `recompute_modules`; the replay passes the same object,
so the same facts) and pinned for the duration of every call with those params. Params without facts (not a DCP
micro-batch's) keep the module's attribute.
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
        selective = microbatch_selective_recompute(packed_seq_params)
        if group is None and selective is None:
            return original_forward(self, hidden_states, *args, **kwargs)
        static_groups, module_selective = self.pg_collection, self.checkpoint_core_attention
        if group is not None:
            microbatch_groups = copy.copy(static_groups)
            microbatch_groups.cp = group
            self.pg_collection = microbatch_groups
        if selective is not None:
            self.checkpoint_core_attention = selective
        try:
            return original_forward(self, hidden_states, *args, **kwargs)
        finally:
            self.pg_collection, self.checkpoint_core_attention = static_groups, module_selective

    forward.dcp_original = original_forward
    return forward


def microbatch_selective_recompute(packed_seq_params):
    """Whether the DCP micro-batch these params belong to recomputes core attention (None: not a DCP
    micro-batch's params), from the facts they carry, at its forward and at every replay alike."""
    from dcp_megatron.core.microbatch_facts import facts_of

    facts = facts_of(packed_seq_params)
    return None if facts is None else "core_attn" in facts.recompute_modules


def dcp_patches() -> tuple[Patch, ...]:
    from megatron.core.transformer.attention import Attention

    original = vars(Attention)["forward"]
    original = getattr(original, "dcp_original", original)
    return (
        Patch(
            target=_TARGET,
            replacement=_with_microbatch_cp_group(original),
            reason="RoPE of packed rows reads the static CP group, and a full-recompute replay reads the latest "
                   "micro-batch's selective recompute; DCP micro-batches carry their own group and choice.",
            versions=MEGATRON_CORE_VERSIONS,
        ),
    )
