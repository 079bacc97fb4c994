"""Patch for `megatron.core.transformer.multi_latent_attention` (under --dcp, DCP micro-batches only): multi-latent
attention runs a micro-batch on its own CP group, with its rotary part per document.

megatron-core 0.19.2's `MultiLatentAttention.forward` does not go through `Attention.forward` (whose patch,
patches/transformer_attention.py, hands RoPE the micro-batch's group), and it differs in three places:
- `get_query_key_value_tensors` asserts `packed_seq_params.local_cp_size is None` (it takes a set value for
  Megatron dev's hybrid CP, which it does not support). A DCP micro-batch's params name their CP size there; that
  call alone gets a copy without it, carrying the same group and facts. Core attention keeps the size (TE's reads
  `local_cp_size=1` without a group as "turn CP off": a CP-1 micro-batch after a CP-2 one);
- RoPE of the rotary part reads `pg_collection.cp` (the static group, size 1 under DCP): swapped for the
  micro-batch's group for the call, as the Attention patch does;
- with packed rows and `config.context_parallel_size == 1` it cuts the rotary table to this rank's row count, which
  is shorter than a document the group shares (positions run to the padded document length): for a micro-batch on
  a group of c > 1 the call sees a config copy whose `context_parallel_size` is c, so the table stays whole.
The micro-batch's selective recompute is pinned from its facts, as in the Attention patch. megatron-core's
`mla_up_proj` recompute replays the up-projection and RoPE in backward outside this call, with the static group:
DCP's recompute menu does not offer it (and --recompute-modules is refused under --dcp), so it never runs here.
"""
from __future__ import annotations

import copy
import dataclasses
import functools

from patches import MEGATRON_CORE_VERSIONS
from patches.registry import Patch
from patches.transformer_attention import microbatch_selective_recompute

_TARGET = "megatron.core.transformer.multi_latent_attention:MultiLatentAttention.forward"


def _with_microbatch_cp_group(original_forward):
    @functools.wraps(original_forward)
    def forward(self, hidden_states, *args, **kwargs):
        from dcp_megatron.core.microbatch_facts import attach_facts, facts_of

        params = kwargs.get("packed_seq_params")
        facts = facts_of(params)
        if facts is None:
            return original_forward(self, hidden_states, *args, **kwargs)
        static_groups, static_config, module_selective = self.pg_collection, self.config, self.checkpoint_core_attention
        self.get_query_key_value_tensors = _without_cp_size(self.get_query_key_value_tensors, facts, attach_facts)
        if facts.cp_size > 1:
            microbatch_groups = copy.copy(static_groups)
            microbatch_groups.cp = facts.group
            self.pg_collection = microbatch_groups
            self.config = copy.copy(static_config)
            self.config.context_parallel_size = facts.cp_size
        self.checkpoint_core_attention = microbatch_selective_recompute(params)
        try:
            return original_forward(self, hidden_states, *args, **kwargs)
        finally:
            del self.get_query_key_value_tensors   # the instance's wrapper; the class's method shows again
            self.pg_collection, self.config, self.checkpoint_core_attention = (static_groups, static_config,
                                                                               module_selective)

    forward.dcp_original = original_forward
    return forward


def _without_cp_size(get_query_key_value_tensors, facts, attach_facts):
    """The method, handed a copy of the params without `local_cp_size` (same group and facts)."""
    def call(hidden_states, key_value_states=None, position_ids=None, packed_seq_params=None, **kwargs):
        if packed_seq_params is not None:
            packed_seq_params = attach_facts(dataclasses.replace(packed_seq_params, local_cp_size=None), facts)
        return get_query_key_value_tensors(hidden_states, key_value_states, position_ids, packed_seq_params, **kwargs)

    return call


def dcp_patches() -> tuple[Patch, ...]:
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

    original = vars(MultiLatentAttention)["forward"]
    original = getattr(original, "dcp_original", original)
    return (
        Patch(
            target=_TARGET,
            replacement=_with_microbatch_cp_group(original),
            reason="MLA refuses params naming a CP size, applies RoPE with the static CP group and cuts the rotary "
                   "table to the local rows; DCP micro-batches carry their own group over documents it shares.",
            versions=MEGATRON_CORE_VERSIONS,
        ),
    )
