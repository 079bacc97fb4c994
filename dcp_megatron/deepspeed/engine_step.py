"""One planned training step on a DeepSpeed engine: this rank's micro-batches, one reduction, one update.

The step plan gives every rank of the DCP domain (DeepSpeed's data-parallel group: the world) its own
micro-batches: some run alone, some with a CP group, and ranks run different numbers of them. The
engine is driven so that this is exactly one optimizer step on the whole global batch:

- the accumulation boundary is this rank's last micro-batch, whatever its count: with ZeRO stage 1
  or 2 all of a rank's backwards run inside `engine.coalesce_grad_reduction()` (gradients stay on
  the parameters, one reduction pass when the block closes, the same collectives on every rank); with
  stage 0, every backward but the last runs under `engine.no_sync()`. (Without either, ZeRO-2 reduces
  in every backward and a rank with more micro-batches issues reductions the others never join.)
  Stage 3 gathers weights in every forward and backward, so its plans are lockstep (every rank the same
  count) with one relief per wave, fillers included (a replayed layer gathers its weights again, on every
  rank alike: `check_wave_reliefs` stops a plan that breaks this before anything runs); each backward
  reduce-scatters into the rank's gradient partition, where DeepSpeed accumulates until `step()`
  (coalescing would hold every full gradient on every rank until the step's end).
- the loss is per token: each micro-batch backpropagates its local token-loss sum times
  `world / global tokens`; DeepSpeed averages gradients over the world, so the result is the sum over
  all tokens divided by the global token count: one device's gradient on the whole batch.
  (`backward(scale_wrt_gas=False)`: the engine's 1/GAS scaling stays out; GAS is 1 anyway.)
- each micro-batch's CP group reaches attention through `PackedSeqParams.cp_group` (the batch dicts of
  `megatron/microbatches.rank_batches`, read by the script's forward function; a rank the plan gives
  nothing runs one masked 1-token filler, so it joins the reduction); recompute is switched on the
  model just before each forward.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dcp_megatron.core.microbatches import MICROBATCH_KEY
from dcp_megatron.core.recompute import apply_recompute


@dataclass(frozen=True)
class StepOutcome:
    """What one step did: the global batch's mean token loss, its tokens, this rank's part and timings."""

    loss: float
    num_tokens: int
    num_microbatches: int
    cp_sizes: tuple[int, ...]
    durations: tuple[float, ...]   # seconds per micro-batch (forward + backward), all but the step's last
    seconds: float                 # the whole step, the optimizer's update included
    grad_norm: float | None        # of the reduced gradient, before clipping (None: not known)
    memory_bytes: tuple[float, ...] | None = None   # each micro-batch's measured bytes, when asked


def check_wave_reliefs(plan, iteration: int) -> None:
    """RuntimeError naming the step and wave when a wave's micro-batches (fillers included) do not share one
    relief: under ZeRO-3 the ranks' weight gathers would not pair (the planner plans one per wave, so a bug)."""
    for w, wave in enumerate(plan.waves):
        reliefs = {mb.recompute for group in wave.groups for mb in group.microbatches}
        if len(reliefs) > 1:
            raise RuntimeError(f"step {iteration}, wave {w}: its micro-batches recompute differently "
                               f"({', '.join(sorted(map(str, reliefs)))}); under ZeRO stage 3 every rank of a wave, "
                               f"an idle rank's filler too, must run one relief (a planner bug: its plans give one)")


def _reduction_scopes(engine, count: int):
    """One context per micro-batch such that the step's gradients are reduced exactly once (module docstring)."""
    if engine.zero_optimization_stage() == 3:
        # Every backward reduce-scatters into this rank's partition and accumulates there until step()
        # (stage3.partition_grads, micro_step_id > 0): sharded gradients, and the same collectives on
        # every rank because the plan is lockstep (one micro-batch per wave on every rank).
        return contextlib.nullcontext(), [contextlib.nullcontext() for _ in range(count)]
    if engine.zero_optimization_stage() in (1, 2):
        return engine.coalesce_grad_reduction(), [contextlib.nullcontext() for _ in range(count)]
    # Stage 0: DeepSpeed all-reduces at the end of a boundary backward outside no_sync.
    return contextlib.nullcontext(), [engine.no_sync() for _ in range(count - 1)] + [contextlib.nullcontext()]


def run_planned_step(engine, batches: list[dict], *, forward_loss, num_tokens: int,
                     world_size: int, memory=None) -> StepOutcome:
    """Forward/backward every micro-batch of this rank, then `engine.step()` (a collective over the world).

    `forward_loss(engine, batch)` -> (sum of the batch's masked token losses, its valid token count); `memory`:
    runtime/measured_memory.py's reading of each micro-batch (read before the update allocates anything)."""
    if num_tokens < 1:
        raise ValueError(f"a step needs at least one token to train, got {num_tokens}")
    started = time.perf_counter()
    scale = world_size / num_tokens
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    local = torch.zeros(2, dtype=torch.float64, device=device)
    marks = []
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)  # kernels run async
    outer, scopes = _reduction_scopes(engine, len(batches))
    with outer:
        for batch, scope in zip(batches, scopes):
            apply_recompute(engine.module, batch[MICROBATCH_KEY].recompute)
            sync()
            marks.append(time.perf_counter())
            with scope:
                if memory is not None:   # the forward alone under it (a reading ends at the next one, or below)
                    loss_sum, valid = memory.run_forward(lambda saved, batch=batch: forward_loss(engine, batch))
                else:
                    loss_sum, valid = forward_loss(engine, batch)
                engine.backward(loss_sum * scale, scale_wrt_gas=False)
            local += torch.stack([loss_sum.detach().double(), torch.tensor(float(valid), dtype=torch.float64,
                                                                             device=device)])
    sync()
    marks.append(time.perf_counter())
    memory_bytes = tuple(memory.finish()) if memory is not None else None
    dist.all_reduce(local)   # before the update: a step that lost tokens or went non-finite must not apply
    total_loss, total_tokens = local.tolist()
    if int(round(total_tokens)) != num_tokens:
        raise RuntimeError(f"the step trained {int(round(total_tokens))} tokens, its global batch holds {num_tokens}: "
                           "a micro-batch lost or repeated tokens")
    if not math.isfinite(total_loss):
        raise FloatingPointError(f"the step's loss is {total_loss / num_tokens} (not finite): stopping before the "
                                 "optimizer applies it and before any checkpoint is saved; lower the learning rate "
                                 "or enable gradient_clipping")
    grad_norm = _reduced_grad_norm(engine) if engine.zero_optimization_stage() == 0 else None
    engine.step()
    if grad_norm is None and engine.get_global_grad_norm() is not None:
        grad_norm = float(engine.get_global_grad_norm())
    durations = tuple(b - a for a, b in zip(marks[:-1], marks[1:]))
    timed = durations[:-1] if engine.zero_optimization_stage() == 0 else durations
    return StepOutcome(loss=total_loss / num_tokens, num_tokens=num_tokens, num_microbatches=len(batches),
                       cp_sizes=tuple(sorted({b[MICROBATCH_KEY].cp_size for b in batches})),
                       durations=timed, seconds=time.perf_counter() - started, grad_norm=grad_norm,
                       memory_bytes=memory_bytes)


def _reduced_grad_norm(engine) -> float:
    # Stage 0 reduced the gradients into .grad in the last backward; DeepSpeed records no norm for it.
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))
