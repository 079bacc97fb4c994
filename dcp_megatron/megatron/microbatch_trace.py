"""--dcp-dump-plans DIR also records what each micro-batch really ran with, on every rank.

Loss and gradients do not show whether a micro-batch ran on the CP group or with the recompute its plan
named (a micro-batch handed the previous one's group, or a recompute never applied, trains the same
numbers; only speed and memory differ). So, when plans are dumped, a forward pre-hook on each model
chunk's decoder reads what the decoder is handed: the CP group in its `packed_seq_params` (built by the
user's forward step from the batch) and the recompute set on the model at that moment (the shared
config's full recompute, the attention modules' selective flag). One JSON line per micro-batch and
chunk, in `DIR/microbatches_rank{global rank}.jsonl`; tests compare them with the dumped plans.
"""
from __future__ import annotations

import json
import os

import torch

from dcp_megatron.megatron.recompute import decoder_layers, transformer_block


def recompute_seen(config, layers) -> str:
    """The recompute a forward runs with, named like the plan's (`none`, `selective`, `full<k>`)."""
    if config.recompute_granularity == "full":
        return f"full{config.recompute_num_layers}"
    flags = {bool(layer.self_attention.checkpoint_core_attention) for layer in layers}
    return {frozenset([False]): "none", frozenset([True]): "selective"}.get(frozenset(flags), "mixed")


class MicrobatchTrace:
    """Records each decoder forward of one training step (see the module docstring)."""

    def __init__(self, directory: str, *, rank: int) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"microbatches_rank{rank}.jsonl")
        self._handles: list = []
        self._records: list[dict] = []

    def attach(self, model_chunks, config, *, iteration: int) -> None:
        for chunk_index, chunk in enumerate(model_chunks):
            decoder = transformer_block(chunk)
            layers = decoder_layers(chunk)

            def record(module, args, kwargs, chunk_index=chunk_index, layers=layers):
                params = kwargs.get("packed_seq_params")
                group = getattr(params, "cp_group", None)
                ranks = torch.distributed.get_process_group_ranks(group) if group is not None else None
                self._records.append({"iteration": iteration, "chunk": chunk_index, "group_ranks": ranks,
                                      "recompute": recompute_seen(config, layers)})

            self._handles.append(decoder.register_forward_pre_hook(record, with_kwargs=True))

    def detach(self) -> None:
        """Remove the hooks and append this step's records to the rank's file."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        with open(self.path, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in self._records)
        self._records.clear()
