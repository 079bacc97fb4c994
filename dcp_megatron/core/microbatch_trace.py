"""--dcp-dump-plans DIR also records what each micro-batch really ran, on every rank.

Loss and gradients do not show whether a micro-batch ran on the CP group or with the recompute its plan
named (a micro-batch handed the previous one's group, or a recompute never applied, trains the same
numbers; only speed and memory differ). A switch set on the model says what was asked, not what ran, so
the trace counts what ran: modules whose forward runs again while autograd runs a backward are
checkpoint replays, i.e. recompute that happened.

- A forward pre-hook on each model chunk's decoder reads the CP group in the `packed_seq_params` it is
  handed (built by the user's forward step from the batch) and opens the micro-batch's record.
- A hook on the decoder's output tensor fires when that micro-batch's backward reaches it, before any of
  its layers replay: it ties the running backward (autograd's graph task) to the record.
- Forward hooks on every watched module of every layer (`WATCHED`: the layer itself, core attention, the
  MLP) count the forwards that run inside a backward, on the record of that backward. Full recompute of
  k layers replays k layers (and their attention and MLP); module recompute replays those modules in every layer
  (core attention: `selective`; the MLP: `mlp`; both: `core_attn+mlp`). A new relief kind is one more entry in
  `WATCHED` and `recompute_ran`.

One JSON line per micro-batch and chunk, in `DIR/microbatches_rank{global rank}.jsonl`: `recompute` is what
ran (named like the plan's: `none`, `full<k>`, a module set; `mixed(...)` for anything else), `recompute_set`
what the model's switches said at the forward, `replayed` the counts. Tests compare them with the plans.
"""
from __future__ import annotations

import json
import os

import torch

from dcp_megatron.core.recompute import decoder_layers, modules_name, modules_on, transformer_block

# Per layer: the modules whose replays the trace counts, by name.
WATCHED = (("layer", lambda layer: layer), ("core_attention", lambda layer: layer.self_attention.core_attention),
           ("mlp", lambda layer: layer.mlp))


def recompute_seen(config, layers) -> str:
    """The recompute the model's switches ask for at a forward, named like the plan's."""
    if config.recompute_granularity == "full":
        return f"full{config.recompute_num_layers}"
    modules = modules_on(layers)
    return "mixed" if modules is None else modules_name(modules)


def recompute_ran(replayed: dict[str, int], num_layers: int) -> str:
    """The recompute a micro-batch's backward replayed, named like the plan's."""
    layers, attention, mlp = replayed.get("layer", 0), replayed.get("core_attention", 0), replayed.get("mlp", 0)
    if layers == attention == mlp == 0:
        return "none"
    if layers and attention == mlp == layers:
        return f"full{layers}"
    if not layers and {attention, mlp} <= {0, num_layers}:
        return modules_name({name for name, count in (("core_attn", attention), ("mlp", mlp)) if count})
    return "mixed(" + ",".join(f"{name}={n}" for name, n in sorted(replayed.items())) + ")"


def _in_backward() -> bool:
    """Whether autograd is running a backward on this thread (a forward now is a checkpoint replay)."""
    return torch._C._current_graph_task_id() != -1


class MicrobatchTrace:
    """Records each decoder forward of one training step and what its backward replayed (module docstring)."""

    def __init__(self, directory: str, *, rank: int) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"microbatches_rank{rank}.jsonl")
        self._handles: list = []
        self._records: list[dict] = []
        self._backward_of: dict[int, dict] = {}   # autograd graph task -> the record whose backward it runs
        self._unattributed: dict[str, int] = {}    # replays in a backward no traced micro-batch started
        self._iteration = None

    def attach(self, model_chunks, config, *, iteration: int) -> None:
        self._iteration = iteration
        for chunk_index, chunk in enumerate(model_chunks):
            decoder = transformer_block(chunk)
            layers = decoder_layers(chunk)
            chunk_config = getattr(decoder, "config", config)   # each virtual stage's own (core/recompute.py)

            def opened(module, args, kwargs, chunk_index=chunk_index, layers=layers, chunk_config=chunk_config):
                params = kwargs.get("packed_seq_params")
                group = getattr(params, "cp_group", None)
                ranks = torch.distributed.get_process_group_ranks(group) if group is not None else None
                self._records.append({"iteration": iteration, "chunk": chunk_index, "group_ranks": ranks,
                                      "recompute_set": recompute_seen(chunk_config, layers), "num_layers": len(layers),
                                      "replayed": {name: 0 for name, _ in WATCHED}})

            def closed(module, args, kwargs, output):
                if _in_backward():
                    return
                record = self._records[-1]
                hidden = output[0] if isinstance(output, tuple) else output
                if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
                    hidden.register_hook(lambda grad, record=record: self._enter_backward(record))

            self._handles.append(decoder.register_forward_pre_hook(opened, with_kwargs=True))
            self._handles.append(decoder.register_forward_hook(closed, with_kwargs=True))
            for layer in layers:
                for name, module_of in WATCHED:
                    self._handles.append(module_of(layer).register_forward_hook(
                        lambda module, args, output, name=name: self._count_replay(name)))

    def _enter_backward(self, record: dict) -> None:
        self._backward_of[torch._C._current_graph_task_id()] = record

    def _count_replay(self, name: str) -> None:
        if not _in_backward():
            return
        record = self._backward_of.get(torch._C._current_graph_task_id())
        counts = self._unattributed if record is None else record["replayed"]
        counts[name] = counts.get(name, 0) + 1

    def detach(self) -> None:
        """Remove the hooks and append this step's records, with what ran, to the rank's file."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for record in self._records:
            record["recompute"] = recompute_ran(record["replayed"], record.pop("num_layers"))
        if self._unattributed:   # said, not dropped: a test reading the trace fails on it
            self._records.append({"iteration": self._iteration, "unattributed_replays": dict(self._unattributed)})
        with open(self.path, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in self._records)
        self._records.clear()
        self._backward_of.clear()
        self._unattributed.clear()
