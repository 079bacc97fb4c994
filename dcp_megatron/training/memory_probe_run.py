"""The memory probe before step 1 (`--dcp-memory-probe`, on by default on GPU): the count calibrated before any
real plan is made.

For each relief kind the run may use (every light relief on its menu, and full recompute of all the stage's
layers), the largest micro-batch the planner allows at that relief (`max_local_tokens` at CP 1: --seq-length
documents and the rest) is built from synthetic tokens (the profiler's) and run once, forward and backward,
through Megatron's own schedule and the user's forward step, by every rank at once (each alone: CP 1, so no CP
collective is left unpaired; TP and EP peers run the same rows). Each micro-batch is read as the online
refinement reads the first steps (runtime/measured_memory.py: the allocator's peak on GPU, the bytes saved for
backward on CPU) against the uncorrected count, and the readings calibrate the memory correction through the
loop (`PlannedStepLoop.calibrate_memory`: one MAX all-reduce). One log line per kind says counted vs measured.

The probe leaves training as without it (core/probe_guard.py: gradients, RNG, buffers, loggers); it runs from
the first training step's forward-backward call, where Megatron has just zeroed the gradients and the rerun state
machine validates nothing yet (it never validates a process's first iteration).
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass

import torch

from dcp_megatron.config import DcpUsageError
from dcp_megatron.core.out_of_memory import LIMIT_HEADROOM
from dcp_megatron.core.microbatches import build_batch
from dcp_megatron.core.offload import offload_built, own_warmup_every_step
from dcp_megatron.core.probe_guard import untouched_training_state
from dcp_megatron.core.recompute import restore_recompute, snapshot_recompute
from dcp_megatron.planner.costmodel.memory_correction import MemoryReading
from dcp_megatron.planner.plan import Recompute
from dcp_megatron.runtime.backward_queue import BackwardQueueSentinel
from dcp_megatron.runtime.device_ceiling import active_ceiling
from dcp_megatron.runtime.measured_memory import PEAK, counted_bytes, memory_readings
from dcp_megatron.training.forward_step import DcpForwardStep
from dcp_megatron.training.profiler import synthetic_documents

GiB = 1024 ** 3


@dataclass(frozen=True)
class ProbeRow:
    """One relief's probe on this rank: its micro-batch, the count and this rank's reading."""

    relief: str
    lengths: tuple[int, ...]
    counted_bytes: float
    measured_bytes: float
    out_of_memory: bool = False   # it ran out of memory: measured_bytes is the raised count (out_of_memory_ratio)


def out_of_memory_ratio(ceiling, static_bytes: int | None) -> float:
    """What a probe that ran out of memory reads as measured / counted: above 1 / LIMIT_HEADROOM, and on an emulated
    device how far its activations went past the room beside the static state: (attempted - static) / (device -
    static)."""
    floor = 1.0 / LIMIT_HEADROOM
    if ceiling is None or ceiling.attempted_bytes is None or static_bytes is None:
        return floor
    room = ceiling.limit_bytes - static_bytes
    if room <= 0:
        return floor
    return max(floor, (ceiling.attempted_bytes - static_bytes) / room / LIMIT_HEADROOM)


def probe_reliefs(cost) -> list[Recompute]:
    """The relief kinds the run may use: each light relief on the menu and full recompute of every layer."""
    options = cost.recompute_options()
    light = [r for r in options if r.kind != "full"]
    full = [r for r in options if r.kind == "full"]
    return light + full[-1:]


def probe_lengths(max_local_tokens: int, seq_length: int) -> tuple[int, ...]:
    """Documents filling `max_local_tokens` at CP 1: --seq-length ones and the rest, each of even length (CP 1's
    padding unit), so the micro-batch counts exactly what the planner allows."""
    total, longest = max_local_tokens - max_local_tokens % 2, seq_length - seq_length % 2
    if total <= 0 or longest <= 0:
        return ()
    whole, rest = divmod(total, longest)
    return (longest,) * whole + ((rest,) if rest else ())


def probe_memory(loop, forward_step_func, model_chunks, *, schedule, seq_length: int, vocab_size: int,
                 is_logging_rank: bool) -> list[ProbeRow]:
    """Probe each relief once on every rank and calibrate `loop`'s memory count (module docstring)."""
    from megatron.core.utils import get_model_config

    config = get_model_config(model_chunks[0])
    cost = loop.base_cost
    started = time.perf_counter()
    rows = []
    saved_recompute = snapshot_recompute(model_chunks)
    ceiling = active_ceiling()
    try:
        with untouched_training_state(model_chunks, config):
            for index, relief in enumerate(probe_reliefs(cost)):
                lengths = probe_lengths(cost.max_local_tokens(relief), seq_length)
                if not lengths:   # nothing fits beside the static state at this relief
                    continue
                counted = counted_bytes(cost, lengths, 1, relief, loop.memory_kind)
                static = ceiling.live_bytes if ceiling is not None else None
                sentinel = BackwardQueueSentinel()
                try:
                    batch = build_batch(synthetic_documents(lengths, vocab_size, seed=index), cp_size=1, cp_rank=0,
                                        group=None, recompute=relief, wave_index=0, device=loop.device,
                                        pad_multiple=loop.pad_multiple, row_multiple=loop.config.row_multiple)
                    measured = _run_once(schedule, forward_step_func, model_chunks, config, batch, loop=loop,
                                         seq_length=seq_length)
                    out_of_memory = False
                except torch.OutOfMemoryError:   # the relief's count was low: raise its factor, the run goes on
                    measured, out_of_memory = counted * out_of_memory_ratio(ceiling, static), True
                if out_of_memory:
                    sentinel.release()   # a failed backward's queued nodes (runtime/backward_queue.py)
                    gc.collect()   # the failed pass's tensors sit in reference cycles with its traceback
                rows.append(ProbeRow(relief=str(relief), lengths=lengths, measured_bytes=measured,
                                     counted_bytes=counted, out_of_memory=out_of_memory))
    finally:
        restore_recompute(model_chunks, saved_recompute)
    buckets = sorted(str(r) for r in probe_reliefs(cost))   # the same on every rank: they share the cost model
    # (the probe's micro-batches fill the budget: packed_bytes their count against it, above the noise floor)
    relief_of = {str(r): r for r in probe_reliefs(cost)}
    scale = loop.calibrate_memory([MemoryReading(r.relief, r.counted_bytes, r.measured_bytes, packed_bytes=counted_bytes(
        cost, r.lengths, 1, relief_of[r.relief], PEAK)) for r in rows], buckets)
    for row in rows:   # a rank whose probe ran out of memory says so itself
        if row.out_of_memory and not is_logging_rank:
            print(probe_line(row, worst_ratio=loop.memory_ratios.get(row.relief, 0.0), factor=scale.of(row.relief),
                             kind=loop.memory_kind), flush=True)
    if is_logging_rank:
        for row in rows:
            print(probe_line(row, worst_ratio=loop.memory_ratios.get(row.relief, 0.0), factor=scale.of(row.relief),
                             kind=loop.memory_kind), flush=True)
        print(f" dcp memory probe | {len(rows)} reliefs in {time.perf_counter() - started:.1f} s | memory count "
              f"factors now {', '.join(f'{k} x{v:.2f}' for k, v in sorted(scale.factors.items())) or 'as counted'}"
              f" (others x{scale.default:.2f}, margin {loop.memory_margin:.0%})", flush=True)
    try:
        loop.check_longest_fits()
    except DcpUsageError as err:
        raise DcpUsageError(f"after the memory probe (the lines above: the count was low): {err}") from None
    return rows


def probe_line(row: ProbeRow, *, worst_ratio: float, factor: float, kind: str) -> str:
    """` dcp memory probe | relief mlp | 3 documents, 24576 tokens at CP 1 | counted ... measured ...`."""
    what = "peak above the static state" if kind == "peak" else "saved for backward"
    if row.out_of_memory:
        return (f" dcp memory probe | relief {row.relief} | {len(row.lengths)} documents, {sum(row.lengths)} tokens at "
                f"CP 1 | out of memory on this rank: its count raised x{row.measured_bytes / row.counted_bytes:.2f} "
                f"(worst rank x{worst_ratio:.2f}) | factor x{factor:.2f}; the run goes on")
    return (f" dcp memory probe | relief {row.relief} | {len(row.lengths)} documents, {sum(row.lengths)} tokens at "
            f"CP 1 | {what}: counted {row.counted_bytes / GiB:.4f} GiB, measured {row.measured_bytes / GiB:.4f} GiB "
            f"on this rank (x{row.measured_bytes / row.counted_bytes if row.counted_bytes else 0:.2f}; worst rank "
            f"x{worst_ratio:.2f}) | factor x{factor:.2f}")


def _run_once(schedule, forward_step_func, model_chunks, config, batch: dict, *, loop, seq_length: int) -> float:
    """One micro-batch through Megatron's schedule, forward and backward; its measured bytes."""
    memory = memory_readings(cuda=loop.memory_kind == "peak",
                             parameters=[p for chunk in model_chunks for p in chunk.parameters()])
    step = DcpForwardStep(forward_step_func, [batch], model_chunks=model_chunks, config=config, memory=memory,
                          saved_bytes_dir=None)
    if offload_built(config):   # GPU: the probe's offload set is its own warm-up, as every step's
        own_warmup_every_step()
    schedule(forward_step_func=step, data_iterator=iter(()), model=model_chunks, num_microbatches=1,
             seq_length=seq_length, micro_batch_size=1, forward_only=False)
    readings = step.memory_readings()
    assert len(readings) == 1, f"the probe ran {len(readings)} forward steps for one micro-batch"
    return readings[0]
