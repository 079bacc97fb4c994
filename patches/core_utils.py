"""Patches for `megatron.core.utils`.

CPU shim (no GPU only): the module's `torch` is a CPU view (GlobalMemoryBuffer and the batch
broadcast helpers allocate on torch.cuda.current_device()).

DCP: a DCP micro-batch (a batch dict carrying its `MicroBatchFacts` under `dcp_microbatch`, see
dcp_megatron/core/microbatch_facts.py) is already this rank's zig-zag shard of its documents, in
THD form. Megatron-LM's `get_batch` passes every batch through two helpers of this module, which
the script imports by name:
- `flatten_batch_for_packed_sequences` merges per-sample `cu_seqlens`, cutting each row at the first
  entry equal to the local row count; DCP bounds are global (a CP group's, TE's convention), so the
  cut would be wrong: a DCP batch is returned as it is (it is already one packed row);
- `get_batch_on_this_cp_rank` would re-shard over the static CP group; for a DCP batch it instead
  sets `hybrid_cp_group` to the micro-batch's own group (the facts' `group`, None for a group of one),
  which the script passes to `PackedSeqParams.cp_group` - how each micro-batch's group reaches attention.
- `get_batch_on_this_tp_rank` broadcasts TP rank 0's batch into `[micro_batch, seq_length]` buffers on
  the other TP ranks; every TP rank already holds its own copy of a DCP micro-batch (of its own
  shape), so each rank gets that copy and nothing is broadcast.
The first two receive the batch dict and read the facts in it. The third cannot: on TP ranks > 0
Megatron-LM's `get_batch` never reads the data iterator and hands it a fresh empty dict
(pretrain_gpt.py core_v0.19.0, lines 123-133: `batch = {}`, `next(data_iterator)` on TP rank 0 only, then
`get_batch_on_this_tp_rank(batch, ...)`), and megatron-core's helper takes nothing else of the micro-batch
(megatron/core/utils.py:2119 in 0.19.2: the dict, the broadcast group and static sizes; line 2265 on:
TP ranks > 0 allocate `[micro_batch_size, seq_length]` buffers). No PackedSeqParams exists yet. So it reads
the batch of the forward step `DcpForwardStep` is running (`batch_of_running_forward_step()`,
dcp_megatron/training/forward_step.py), the one context variable DCP keeps, set only for that call.
Any other batch goes to Megatron's functions unchanged.
"""
from __future__ import annotations

import functools
import importlib

from patches.cpu_torch import cpu_torch_patch
from dcp_megatron.core.microbatch_facts import MICROBATCH_KEY as _MICROBATCH_KEY
from patches import MEGATRON_CORE_VERSIONS
from patches.registry import Patch

_MODULE = "megatron.core.utils"

CPU_PATCHES = (cpu_torch_patch(_MODULE, "GlobalMemoryBuffer and batch broadcasts allocate on "
                                        "torch.cuda.current_device().", MEGATRON_CORE_VERSIONS),)


def _keep_dcp_batch(original):
    @functools.wraps(original)
    def flatten_batch_for_packed_sequences(batch, *args, **kwargs):
        if isinstance(batch, dict) and batch.get(_MICROBATCH_KEY) is not None:
            return batch
        return original(batch, *args, **kwargs)

    flatten_batch_for_packed_sequences.dcp_original = original
    return flatten_batch_for_packed_sequences


def _dcp_group_for_batch(original):
    @functools.wraps(original)
    def get_batch_on_this_cp_rank(batch, *args, **kwargs):
        facts = batch.get(_MICROBATCH_KEY) if isinstance(batch, dict) else None
        if facts is None:
            return original(batch, *args, **kwargs)
        batch["hybrid_cp_group"] = facts.group
        return batch

    get_batch_on_this_cp_rank.dcp_original = original
    return get_batch_on_this_cp_rank


_TP_BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask", "cu_seqlens",
                  "cu_seqlens_padded", "max_seqlen", "local_cp_size", "hybrid_cp_group")


def _dcp_batch_on_every_tp_rank(original):
    @functools.wraps(original)
    def get_batch_on_this_tp_rank(batch, *args, **kwargs):
        from dcp_megatron.training.forward_step import batch_of_running_forward_step

        current = batch_of_running_forward_step()
        if current is None:
            return original(batch, *args, **kwargs)
        if batch and batch.get(_MICROBATCH_KEY) is not current.get(_MICROBATCH_KEY):
            raise RuntimeError("get_batch read a different batch than the DCP micro-batch of this forward step")
        # The keys upstream returns on TP ranks > 0 (Megatron-LM's get_batch indexes them all).
        return {**dict.fromkeys(_TP_BATCH_KEYS), **current}

    get_batch_on_this_tp_rank.dcp_original = original
    return get_batch_on_this_tp_rank


def dcp_patches() -> tuple[Patch, ...]:
    module = importlib.import_module(_MODULE)

    def unwrapped(name: str):
        function = getattr(module, name)
        return getattr(function, "dcp_original", function)

    return (
        Patch(target=f"{_MODULE}:flatten_batch_for_packed_sequences",
              replacement=_keep_dcp_batch(unwrapped("flatten_batch_for_packed_sequences")),
              reason="would cut a DCP micro-batch's global cu_seqlens at its local row count.",
              versions=MEGATRON_CORE_VERSIONS),
        Patch(target=f"{_MODULE}:get_batch_on_this_cp_rank",
              replacement=_dcp_group_for_batch(unwrapped("get_batch_on_this_cp_rank")),
              reason="a DCP micro-batch is already sharded; its own CP group becomes the batch's hybrid_cp_group.",
              versions=MEGATRON_CORE_VERSIONS),
        Patch(target=f"{_MODULE}:get_batch_on_this_tp_rank",
              replacement=_dcp_batch_on_every_tp_rank(unwrapped("get_batch_on_this_tp_rank")),
              reason="would broadcast a DCP micro-batch into [micro_batch, seq_length] buffers; every TP rank "
                     "already holds its own copy.",
              versions=MEGATRON_CORE_VERSIONS),
    )
