"""Patch for `megatron.core.models.gpt.gpt_model` (under --dcp, DCP micro-batches only): a pipeline stage that
builds its `PackedSeqParams` without the micro-batch's CP size and group gets them.

Megatron-LM's pretrain_gpt.py (core_v0.19.0) hands a middle pipeline stage (or middle virtual-stage chunk) only
`cu_seqlens`, `cu_seqlens_padded` and `max_seqlen` from `get_batch`: its `PackedSeqParams` there has
`local_cp_size=None, cp_group=None`, so a CP-2 micro-batch would run its middle layers' attention and RoPE as if it
were alone on the rank (seen: PP 4 x VPP 2 on a 2-rank domain, RoPE splitting 1,024 rows out of 512). The first
and last stages get both from `get_batch` (patches/core_utils.py). `GPTModel.forward` is where every stage's
model receives the params, carrying the micro-batch's facts (`facts_of`, dcp_megatron/core/microbatch_facts.py;
`DcpForwardStep` attaches them as the user's step calls the model): params of a DCP micro-batch without
`local_cp_size` are completed with the facts' CP size and group (a copy, which carries the same facts; recompute
replays the layers with the completed copy). Params without facts pass through.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect

from patches import MEGATRON_CORE_VERSIONS
from patches.registry import Patch

_TARGET = "megatron.core.models.gpt.gpt_model:GPTModel.forward"


def _with_microbatch_cp(original_forward):
    signature = inspect.signature(original_forward)

    @functools.wraps(original_forward)
    def forward(self, *args, **kwargs):
        from dcp_megatron.core.microbatch_facts import attach_facts, facts_of

        bound = signature.bind(self, *args, **kwargs)
        params = bound.arguments.get("packed_seq_params")
        facts = facts_of(params)
        if facts is None or params.local_cp_size is not None:
            return original_forward(self, *args, **kwargs)
        bound.arguments["packed_seq_params"] = attach_facts(
            dataclasses.replace(params, local_cp_size=facts.cp_size, cp_group=facts.group), facts)
        return original_forward(*bound.args, **bound.kwargs)

    forward.dcp_original = original_forward
    return forward


def dcp_patches() -> tuple[Patch, ...]:
    from megatron.core.models.gpt.gpt_model import GPTModel

    original = vars(GPTModel)["forward"]
    original = getattr(original, "dcp_original", original)
    return (
        Patch(target=_TARGET, replacement=_with_microbatch_cp(original),
              reason="Megatron-LM's get_batch gives middle pipeline stages no local_cp_size or CP group; a DCP "
                     "micro-batch's stage must run its attention on the micro-batch's group.",
              versions=MEGATRON_CORE_VERSIONS),
    )
