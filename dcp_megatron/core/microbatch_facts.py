"""The one carrier of a DCP micro-batch's facts: what the patches and our core attention need to know of the
micro-batch they run, besides its tensors.

`build_batch` (microbatches.py) makes one `MicroBatchFacts` per micro-batch; nothing changes it afterwards. It
reaches code by two explicit roads, both holding this very object:

- the micro-batch's batch dict, under `MICROBATCH_KEY` ("dcp_microbatch"): what Megatron-LM's `get_batch` and its
  helpers receive (patches/core_utils.py), and what both engines' steps read (recompute, CP sizes for the log);
- the micro-batch's `PackedSeqParams`, as the attribute of the same name, set by `attach_facts` and read by
  `facts_of`: what the model, every layer, attention and every recompute replay receive. It is the one attribute
  DCP adds to an upstream object. The DeepSpeed adapter attaches it where it builds the params
  (pretrain_scripts/pretrain_gpt_deepspeed.py); under megatron.training the user's forward step builds them, and
  `DcpForwardStep` attaches the facts when that step calls the model (dcp_megatron/training/forward_step.py).

A full-recompute replay in backward gets the same params object as its forward, so it reads the facts of its own
micro-batch, not those of the micro-batch that ran last (under 1F1B, later forwards run before earlier backwards).
Params without facts are not a DCP micro-batch's: every reader then leaves upstream's behaviour alone.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from dcp_megatron.core.recompute import modules_of
from dcp_megatron.planner.plan import Recompute
from dcp_megatron.runtime.sharding import LocalShard, shard_microbatch

MICROBATCH_KEY = "dcp_microbatch"   # the batch dict's key and the PackedSeqParams attribute holding the facts


@dataclass(frozen=True)
class MicroBatchFacts:
    """One DCP micro-batch's facts, for every rank of its CP group and TP group (each builds its own, equal copy)."""

    wave_index: int          # the plan's wave this micro-batch runs in (fillers: after the last wave)
    cp_size: int             # its CP group's size c (1: alone on this rank)
    cp_rank: int             # this rank's place in that group, 0 .. c - 1 (its zig-zag chunks r and 2c-1-r)
    group: object            # torch.distributed.ProcessGroup of the group, None for a group of one. Reaches
    #                          `PackedSeqParams.cp_group` (megatron-core's seam for a per-micro-batch CP group):
    #                          attention, RoPE (patches/transformer_attention.py), TE
    recompute: Recompute     # what the plan chose: none, selective (core attention), full k layers. The model's
    #                          switches are set from it before the forward (core/recompute.py); the attention patch
    #                          pins `recompute_modules` for the forward and its replays
    attention: str = "allgather"     # CP attention flavour the plan chose ("allgather" or "ulysses"; c = 1: allgather)
    router_documents: object = None  # moe_aux.RouterDocuments: this rank's rows' documents, for MoE routers'
    #                                  per-document balancing losses (patches/transformer_transformer_layer.py)
    padded_lengths: tuple[int, ...] = ()  # every document's length padded to a multiple of 2c (all ranks' rows
    #                                       together): the global bounds attention uses (`attention_shard`)
    microbatch_index: int = 0        # its place in this rank's micro-batches of the step (plan order, fillers last)

    @property
    def padding_mask(self):
        """bool [1, T_local]: True at padding and filler rows (MoE routers skip them); None without documents."""
        return None if self.router_documents is None else self.router_documents.padding_mask

    @property
    def recompute_modules(self) -> frozenset[str]:
        """The modules this micro-batch recomputes, by megatron-core's `recompute_modules` names (the plan's module
        set; none under full recompute, which replays whole layers)."""
        return modules_of(self.recompute)

    @functools.cached_property
    def attention_shard(self) -> Optional[LocalShard]:
        """This rank's zig-zag share of the padded documents, as CP attention walks it; None without a CP group.

        Built on first read from this object's own fields (`padded_lengths`, `cp_size`, `cp_rank`: what
        `core_attention.shard_from_params` rebuilds from the params' padded bounds), then kept: cached_property
        stores it in the instance's `__dict__`, the dataclass's fields stay as built. Every layer and recompute of
        the micro-batch reads the one shard."""
        if self.cp_size <= 1:
            return None
        lengths = [length for length in self.padded_lengths if length > 0]
        if not lengths or any(length % (2 * self.cp_size) for length in lengths):
            raise ValueError(f"micro-batch of CP size {self.cp_size}: its padded document lengths must be multiples "
                             f"of {2 * self.cp_size}, got {self.padded_lengths}")
        return shard_microbatch(lengths, self.cp_size, self.cp_rank)


def facts_of(packed_seq_params) -> Optional[MicroBatchFacts]:
    """The facts of the DCP micro-batch these params belong to, or None (no params, or not a DCP micro-batch's)."""
    return getattr(packed_seq_params, MICROBATCH_KEY, None)


def attach_facts(packed_seq_params, facts: MicroBatchFacts):
    """Give a micro-batch's `PackedSeqParams` its facts (module docstring); returns the params.

    One params object belongs to one micro-batch: attaching another micro-batch's facts is refused (its replays
    in backward would read the wrong ones)."""
    if not isinstance(facts, MicroBatchFacts):
        raise TypeError(f"attach_facts needs MicroBatchFacts, got {type(facts).__name__}")
    held = facts_of(packed_seq_params)
    if held is not None and held is not facts:
        raise RuntimeError("these PackedSeqParams already belong to another DCP micro-batch; build one "
                           "PackedSeqParams per micro-batch (its recompute replays read its facts)")
    setattr(packed_seq_params, MICROBATCH_KEY, facts)
    return packed_seq_params


def packed_seq_params(batch: dict):
    """megatron-core's PackedSeqParams for a DCP micro-batch dict (packed THD, its CP size and group), with the
    micro-batch's facts attached: what a forward step hands the model (the DeepSpeed trainer's forward_loss)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    bounds = batch["cu_seqlens_padded"].view(-1)
    max_seqlen = int(batch["max_seqlen"].max())
    facts = batch[MICROBATCH_KEY]
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, cu_seqlens_q_padded=bounds,
                             cu_seqlens_kv_padded=bounds, max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen,
                             local_cp_size=facts.cp_size, cp_group=facts.group)
    return attach_facts(params, facts)   # what attention reads of the micro-batch: its shard and CP flavour
