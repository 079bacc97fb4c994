"""How each DCP micro-batch reaches the user's forward step, on every TP rank and pipeline stage.

Megatron-LM's `get_batch` reads the data iterator on TP rank 0 only; the other TP ranks get the
batch by broadcast inside `get_batch_on_this_tp_rank`, into `[micro_batch, seq_length]` buffers. A
DCP micro-batch has its own shape and CP group, and every TP rank already holds its own copy
(each builds its micro-batches from the same plan and documents), so nothing needs broadcasting.

The schedule therefore calls a `DcpForwardStep` in place of the user's forward step. Per call it
takes the rank's next micro-batch, switches the model's recompute to the one the plan chose for it
(on every TP rank and stage alike: recompute replays TP collectives in backward, so all members must
agree) and, on GPU, its activation offload for the duration of the call (core/offload.py), and calls the
user's forward step with an iterator holding just that batch.

The micro-batch's facts (`MicroBatchFacts`, dcp_megatron/core/microbatch_facts.py) reach the model on the
`PackedSeqParams` the user's step builds: for the duration of the call, a forward pre-hook on the model chunk
it was handed (the innermost module under DDP / Float16 wrappers) attaches them to the params of that chunk's
call (`attach_facts`), before any patch reads them (the first, patches/models_gpt_gpt_model.py, is the model's
own forward). Every layer, attention and recompute replay then reads them from the params (`facts_of`).

One seam sees no params: the patched `get_batch_on_this_tp_rank` (patches/core_utils.py), which on TP ranks > 0
is handed an empty dict and no iterator (its docstring says where upstream does so). For it alone,
`batch_of_running_forward_step()` returns the batch while the forward step runs, so TP ranks > 0 take their
own copy instead of receiving a broadcast. The context variable is set only for the duration of one forward
step; outside it Megatron's functions behave as upstream (evaluation, plain runs).
"""
from __future__ import annotations

import contextvars
import functools
import json
import os
import time
from typing import Optional

import torch

from dcp_megatron.core.microbatch_facts import MICROBATCH_KEY, MicroBatchFacts, attach_facts
from dcp_megatron.core.offload import switch_offload
from dcp_megatron.core.recompute import apply_recompute, decoder_layers
from dcp_megatron.runtime.memory_probe import SavedBytes


# Only for get_batch_on_this_tp_rank on TP ranks > 0 (module docstring); patches read the facts from the params.
_RUNNING_BATCH: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar(
    "dcp_batch_of_running_forward_step", default=None)


def batch_of_running_forward_step() -> Optional[dict]:
    """The batch dict of the DCP forward step running on this rank, else None (patches/core_utils.py's TP seam)."""
    return _RUNNING_BATCH.get()


def innermost_module(model):
    """The model under Megatron's DDP / Float16 wrappers: the module whose call receives the micro-batch's params."""
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def facts_on_model_calls(model, facts: MicroBatchFacts):
    """A forward pre-hook on `model`'s innermost module that attaches `facts` to the PackedSeqParams of each of its
    calls (wherever the caller passes them); the handle removes it."""
    from megatron.core.packed_seq_params import PackedSeqParams

    def attach(module, args, kwargs):
        for value in (*args, *kwargs.values()):
            if isinstance(value, PackedSeqParams):
                attach_facts(value, facts)

    return innermost_module(model).register_forward_pre_hook(attach, with_kwargs=True)


class Clock:
    """Marks that can be subtracted: CUDA events on GPU (kernels run asynchronously), a host clock on CPU."""

    def __init__(self, *, cuda: bool, host_clock=time.perf_counter) -> None:
        self.cuda = cuda
        self.host_clock = host_clock

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return self.host_clock()

    def seconds(self, start, end) -> float:
        """Seconds between two marks (on GPU the later one must have completed: synchronize it first)."""
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start


class DcpForwardStep:
    """The user's forward step fed this rank's DCP micro-batches in plan order (module docstring)."""

    def __init__(self, forward_step_func, batches: list[dict], *, model_chunks, config,
                 cuda_events: bool = False, memory=None, saved_bytes_dir: str | None = None) -> None:
        functools.update_wrapper(self, forward_step_func)  # Megatron inspects the step's parameters
        self._forward_step = forward_step_func
        # Virtual pipeline stages: the interleaved schedule runs every micro-batch once per model chunk, each
        # chunk in its own order; each chunk reads the rank's micro-batches from its own iterator.
        self._batches = {id(chunk): iter(batches) for chunk in model_chunks}
        self._model_chunks = model_chunks
        self._stage_layers = sum(len(decoder_layers(chunk)) for chunk in model_chunks)
        self._config = config
        self._clock = Clock(cuda=cuda_events)
        self._marks: list = []    # when each forward started
        self.num_run = 0          # forward steps run, over all model chunks
        self._saved_bytes_dir = saved_bytes_dir   # --dcp-dump-saved-bytes (DcpConfig.dump_saved_bytes), or None
        self._memory = memory     # runtime/measured_memory.py's reading of each micro-batch, or None

    def memory_readings(self) -> list[float]:
        """Each micro-batch's measured bytes, in order (empty when not measured); call after the schedule."""
        return self._memory.finish() if self._memory is not None else []

    def durations(self) -> list[float]:
        """Seconds from each micro-batch's forward to the next one's: its forward and backward under
        Megatron's no-pipelining schedule (F0 B0 F1 B1 ...). The last micro-batch has no next forward
        (and its backward carries the step's gradient reduction): it is not timed."""
        if self._clock.cuda and self._marks:
            self._marks[-1].synchronize()
        return [self._clock.seconds(a, b) for a, b in zip(self._marks, self._marks[1:])]

    def __call__(self, data_iterator, model, *args, **kwargs):
        chunk_batches = (next(iter(self._batches.values())) if len(self._batches) == 1
                         else self._batches.get(id(model)))
        if chunk_batches is None:
            raise AssertionError("the schedule called the forward step with a model chunk DCP was not given")
        try:
            batch = next(chunk_batches)
        except StopIteration:
            raise AssertionError("the schedule ran more forward steps than this rank has DCP micro-batches") from None
        facts = batch[MICROBATCH_KEY]
        for chunk in self._model_chunks:
            apply_recompute(chunk, facts.recompute, stage_layers=self._stage_layers)
        # offload: the plan's set for this forward only; off at rest, which recompute replays in backward read
        # (dcp_megatron/core/offload.py)
        switch_offload(self._model_chunks, self._config, facts.recompute.offload)
        self.num_run += 1
        self._marks.append(self._clock.mark())
        hook = facts_on_model_calls(model, facts)
        token = _RUNNING_BATCH.set(batch)
        try:
            return self._run(batch, model, *args, **kwargs)
        finally:
            _RUNNING_BATCH.reset(token)
            hook.remove()
            switch_offload(self._model_chunks, self._config, frozenset())

    def _run(self, batch: dict, model, *args, **kwargs):
        """The user's forward step, measured where asked (the memory reading, --dcp-dump-saved-bytes)."""
        def forward(saved):
            if saved is None and self._saved_bytes_dir:
                saved = SavedBytes(exclude=[p for chunk in self._model_chunks for p in chunk.parameters()])
                with saved:
                    out = self._forward_step(iter([batch]), model, *args, **kwargs)
                self._write_saved_bytes(batch, saved)
                saved.release()
                return out
            out = self._forward_step(iter([batch]), model, *args, **kwargs)
            if saved is not None and self._saved_bytes_dir:
                self._write_saved_bytes(batch, saved)
            return out

        return self._memory.run_forward(forward) if self._memory is not None else forward(None)

    def _write_saved_bytes(self, batch: dict, saved: SavedBytes) -> None:
        """The forward's saved bytes appended to this rank's record (--dcp-dump-saved-bytes)."""
        facts = batch[MICROBATCH_KEY]
        record = {"wave": facts.wave_index, "microbatch": facts.microbatch_index, "cp_size": facts.cp_size,
                  "local_tokens": int(batch["tokens"].shape[-1]), "documents": len(facts.padded_lengths),
                  "recompute": facts.recompute.to_json(), "saved_bytes": sum(saved.bytes_by_bucket().values())}
        rank = torch.distributed.get_rank()
        os.makedirs(self._saved_bytes_dir, exist_ok=True)
        with open(os.path.join(self._saved_bytes_dir, f"saved_bytes_rank{rank}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
