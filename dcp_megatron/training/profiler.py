"""The profiler's run inside Megatron (`--dcp-profile-out`): the grid of micro-batches through the user's model.

`dcp-profile` (dcp_megatron/profile.py) starts the user's training script with the user's own
flags plus `--dcp --dcp-profile-out P` (and `--dcp-profile-layers N`: the model is built with N
layers). Megatron builds everything as for training — model provider, DDP, optimizer, data — and
calls `train()`, where, under `--dcp-profile-out`, patches/training_training.py calls `run_profile`
instead of the loop. Each grid point (`profile_grid`: document lengths x packing x recompute x CP
size) is one DCP micro-batch dict (the same `build_batch` training uses) run by every rank at once
(the domain split into groups of its CP size: every core busy, as in a step) through Megatron's own
schedule and the user's forward step, with grad sync off: once to warm up (and count the bytes
saved for backward), then once per timed pass over the grid (`repeats` passes, so each point's runs
are spread over the whole profile); each point keeps its fastest run, of the world's slowest rank. Then `costmodel/profile_fit.py` fits the constants on the fit points and scores the
held-back ones; rank 0 writes the profile (scaled to the trained model's layers) and the report.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dcp_megatron.training.forward_step import Clock, DcpForwardStep
from dcp_megatron.core.microbatches import build_batch
from dcp_megatron.training.profile_probes import AttentionTimer, SavedBytesMeter, all_gather_constants
from dcp_megatron.planner.plan import NO_RECOMPUTE, SELECTIVE, Recompute
from dcp_megatron.planner.costmodel.profile_fit import (Measurement, fit_profile, format_report, scaled_to_stage,
                                                        score_profile)


@dataclass(frozen=True, kw_only=True)
class ProfileConfig:
    """What `--dcp-profile-*` asks of a profiling run."""

    out: str
    report: str | None = None
    repeats: int = 3
    trained_layers: int          # the training run's --num-layers (the profile is scaled to it)
    clock: str = "cpu"           # CPU runs: process CPU time ("cpu") or wall time; GPU runs: CUDA events

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"--dcp-profile-repeats must be >= 1, got {self.repeats}")
        if self.clock not in ("cpu", "wall"):
            raise ValueError(f"--dcp-profile-clock must be cpu or wall, got {self.clock!r}")


@dataclass(frozen=True)
class GridPoint:
    lengths: tuple[int, ...]
    cp_size: int
    recompute: Recompute
    held_back: bool


def profile_cp_sizes(domain_size: int, max_cp_size: int | None) -> list[int]:
    """CP sizes the grid runs: powers of two dividing the domain (every rank in a group), up to the cap."""
    limit = min(domain_size, max_cp_size or domain_size)
    sizes, size = [], 1
    while size <= limit:
        if domain_size % size == 0:
            sizes.append(size)
        size *= 2
    return sizes


def _recompute_options(num_layers: int, allowed: tuple[str, ...]) -> list[Recompute]:
    options = [SELECTIVE] if "selective" in allowed else []
    if "full" in allowed:
        counts = range(1, num_layers + 1) if num_layers <= 4 else sorted({1, num_layers // 2, num_layers})
        options += [Recompute("full", k) for k in counts]
    return options


def profile_grid(seq_length: int, cp_sizes: list[int], num_layers: int, allowed_recompute: tuple[str, ...]
                 ) -> list[GridPoint]:
    """Lengths x packing x recompute x CP size; every second kind of point is held back to score the fit.

    Single documents: powers of two from 64 to --seq-length are fitted, the lengths halfway between
    (x1.5) held back (the attention table must interpolate them). Packed short documents fill
    --seq-length (fitted) or half of it (held back). A mixed micro-batch (one long document, a few
    medium, many short ones) is held back. Recompute: each allowed kind on documents of half and all
    of --seq-length (fitted) and three quarters (held back)."""
    points = []
    for cp in cp_sizes:
        lengths, length = [], 64
        while length <= seq_length:
            lengths.append((length, False))
            if length * 3 // 2 <= seq_length and length * 3 // 2 != seq_length:
                lengths.append((length * 3 // 2, True))
            length *= 2
        if seq_length not in [L for L, _ in lengths]:
            lengths.append((seq_length, False))
        points += [GridPoint((L,), cp, NO_RECOMPUTE, held) for L, held in lengths if L >= 32 * cp]
        for short in (64, 256, 1024):
            for total, held in ((seq_length, False), (seq_length // 2, True)):
                if short * 2 <= total and short >= 32 * cp:
                    points.append(GridPoint((short,) * (total // short), cp, NO_RECOMPUTE, held))
        mixed = [seq_length // 2, seq_length // 8, seq_length // 8] + [seq_length // 32] * 4 + [64] * 4
        points.append(GridPoint(tuple(L for L in mixed if L >= 32 * cp), cp, NO_RECOMPUTE, True))
        for recompute in _recompute_options(num_layers, allowed_recompute):
            for L, held in ((seq_length // 2, False), (seq_length, False), (seq_length * 3 // 4, True)):
                if L >= 32 * cp:
                    points.append(GridPoint((L,), cp, recompute, held))
    return points


def _progress(done: int, total: int, started: float, *, final: bool = False) -> None:
    elapsed = time.perf_counter() - started
    left = elapsed / done * (total - done) if done else 0.0
    bar = "#" * (24 * done // total) + "-" * (24 - 24 * done // total)
    text = (f"dcp-profile [{bar}] {done}/{total} grid points | {elapsed:5.0f} s elapsed, ~{left:4.0f} s left")
    if sys.stderr.isatty():
        print("\r" + text, end="\n" if final else "", file=sys.stderr, flush=True)
    elif final or done % max(total // 10, 1) == 0:
        print(text, file=sys.stderr, flush=True)


def synthetic_documents(lengths: tuple[int, ...], vocab_size: int, seed: int) -> list[torch.Tensor]:
    """Random [L, 3] rows (token, label, loss mask 1), the same on every rank (TP peers must agree)."""
    generator = torch.Generator().manual_seed(seed)
    docs = []
    for length in lengths:
        tokens = torch.randint(vocab_size, (length + 1,), generator=generator)
        docs.append(torch.stack([tokens[:-1], tokens[1:], torch.ones(length, dtype=torch.int64)], dim=1))
    return docs


class _GridRunner:
    """Runs one grid point's micro-batch on this rank through Megatron's schedule; times and meters it."""

    def __init__(self, forward_step_func, model_chunks, *, pool, vocab_size: int, seq_length: int,
                 pad_multiple: int, clock: Clock, device, row_multiple: int = 1) -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.rerun_state_machine import get_rerun_state_machine
        from megatron.core.utils import get_model_config

        self.schedule = get_forward_backward_func()
        self.rerun_state_machine = get_rerun_state_machine()
        self.forward_step_func = forward_step_func
        self.model_chunks = model_chunks
        self.config = get_model_config(model_chunks[0])
        self.pool, self.vocab_size, self.seq_length = pool, vocab_size, seq_length
        self.pad_multiple, self.clock, self.device = pad_multiple, clock, device
        self.row_multiple = row_multiple   # FP8: rows aligned as in training (fp8_checks.fp8_row_multiple)
        self.timer = AttentionTimer(model_chunks, clock)
        self.meter = SavedBytesMeter(model_chunks)

    def batch(self, point: GridPoint, seed: int) -> dict:
        rank, cp = self.pool.domain_rank, point.cp_size
        first = rank - rank % cp
        return build_batch(synthetic_documents(point.lengths, self.vocab_size, seed), cp_size=cp, cp_rank=rank - first,
                           group=self.pool.group(first, cp) if cp > 1 else None, recompute=point.recompute,
                           wave_index=0, device=self.device, pad_multiple=self.pad_multiple,
                           row_multiple=self.row_multiple)

    def _run_once(self, batch: dict, *, meter: bool) -> None:
        step = DcpForwardStep(self.forward_step_func, [batch], model_chunks=self.model_chunks, config=self.config)
        forward_step = self._metered(step) if meter else step
        # inside the rerun state machine's loop, as train_step runs the schedule: loss functions that
        # validate their result through it (Megatron-LM's pretrain_gpt.py does) assert they are within one
        while self.rerun_state_machine.should_run_forward_backward(None):
            self.schedule(forward_step_func=forward_step, data_iterator=iter(()), model=self.model_chunks,
                          num_microbatches=1, seq_length=self.seq_length, micro_batch_size=1, forward_only=False)

    def _metered(self, step):
        def metered_step(data_iterator, model, *args, **kwargs):
            with self.meter:
                return step(data_iterator, model, *args, **kwargs)
        metered_step.__wrapped__ = step   # Megatron inspects the step's parameters
        return metered_step

    def saved_bytes(self, batch: dict) -> list[float]:
        """One untimed run (the warm-up): [bytes saved for backward, of which inside the block]."""
        self._run_once(batch, meter=True)
        self._zero_grads()
        return [float(self.meter.saved_bytes), float(self.meter.block_saved_bytes)]

    def time_once(self, batch: dict) -> list[float]:
        """One timed run on this rank: [seconds, attention seconds]."""
        dist.barrier(group=self.pool.domain_group)
        self.timer.reset()
        if self.clock.cuda:
            torch.cuda.synchronize()
            start = time.perf_counter()
        else:
            start = self.clock.host_clock()
        self._run_once(batch, meter=False)
        if self.clock.cuda:
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        else:
            seconds = self.clock.host_clock() - start
        attention = self.timer.seconds()
        self._zero_grads()
        return [seconds, attention]

    def _zero_grads(self) -> None:
        for chunk in self.model_chunks:
            chunk.zero_grad_buffer()


def run_profile(forward_step_func, model_chunks, *, profile: ProfileConfig, dcp, shape, sequence_parallel: bool,
                timeout) -> dict:
    """Profile the model (see the module docstring); returns the report on every rank."""
    from megatron.core.utils import get_model_config

    from dcp_megatron.core.domain import build_group_pool
    from dcp_megatron.planner.costmodel import cluster_preset

    if shape.pp != 1:
        raise ValueError("the profiler runs one pipeline stage: give --pipeline-model-parallel-size 1 and "
                         "--num-layers = the training run's layers per stage")
    has_gpu = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if has_gpu else torch.device("cpu")
    clock = Clock(cuda=has_gpu, host_clock=time.process_time if profile.clock == "cpu" else time.perf_counter)
    pool = build_group_pool(tp_size=shape.tp, pp_size=1, timeout=timeout)
    cp_sizes = profile_cp_sizes(pool.domain_size, dcp.max_cp_size)   # aligned powers of two: the pool has their groups
    grid = profile_grid(dcp.seq_length, cp_sizes, shape.num_layers, dcp.recompute)
    runner = _GridRunner(forward_step_func, model_chunks, pool=pool, vocab_size=shape.vocab_size,
                         seq_length=dcp.seq_length, pad_multiple=shape.tp if sequence_parallel else 1,
                         clock=clock, device=device, row_multiple=dcp.row_multiple)
    if not runner.timer.found:
        raise ValueError("the profiler found no core attention in the model (GPTModel's decoder.layers[i]"
                         ".self_attention.core_attention); it profiles megatron-core GPT models")
    config = get_model_config(model_chunks[0])
    saved_finalize, config.finalize_model_grads_func = config.finalize_model_grads_func, None
    is_logging_rank = dist.get_rank() == 0
    started = time.perf_counter()
    steps = (profile.repeats + 1) * len(grid)
    try:
        # Pass 0 warms every point up and counts its saved bytes; passes 1..R time each point once, so a
        # point's runs are spread over the whole profile (a burst of other work on the machine hits one).
        batches = [runner.batch(point, seed=index) for index, point in enumerate(grid)]
        saved = [runner.saved_bytes(batch) for batch in batches]
        timed: list[list[list[float]]] = [[] for _ in grid]
        for step in range(len(grid), steps):
            index = step % len(grid)
            timed[index].append(runner.time_once(batches[index]))
            if is_logging_rank:
                _progress(step + 1, steps, started, final=step + 1 == steps)
        results = []
        for index in range(len(grid)):
            seconds, attention = min(timed[index])   # the fastest run: other jobs on the machine only add time
            values = torch.tensor([seconds, attention, *saved[index]], dtype=torch.float64, device=device)
            dist.all_reduce(values, op=dist.ReduceOp.MAX)   # the slowest rank of the world
            results.append(values.tolist())
        links = all_gather_constants(pool.domain_group, pool.domain_size, device)
    finally:
        config.finalize_model_grads_func = saved_finalize
        runner.timer.remove()
        runner.meter.remove()
    measurements = [Measurement(lengths=p.lengths, cp_size=p.cp_size, recompute=p.recompute, seconds=r[0],
                                attention_seconds=r[1], saved_bytes=r[2], block_saved_bytes=r[3],
                                held_back=p.held_back) for p, r in zip(grid, results)]
    preset = "cpu"
    if has_gpu:   # the device's preset (planner/costmodel/device_budget.py): its links where none were measured
        from dcp_megatron.planner.costmodel.device_budget import preset_for_device

        preset = preset_for_device(torch.cuda.get_device_name(), torch.cuda.get_device_properties(
            torch.cuda.current_device()).total_memory)[0]
    cluster = cluster_preset(preset, domain_size=pool.domain_size, gpus_per_node=dcp.gpus_per_node)
    bandwidth, latency = links or (cluster.intra_node_bw, cluster.collective_latency_s)
    meta = {"profiled_layers": shape.num_layers, "trained_layers": profile.trained_layers, "tp": shape.tp,
            "hidden_size": shape.hidden_size, "seq_length": dcp.seq_length, "domain_size": pool.domain_size,
            "cp_sizes": cp_sizes, "clock": "cuda-events" if has_gpu else profile.clock, "repeats": profile.repeats,
            "device": torch.cuda.get_device_name() if has_gpu else "cpu", "torch": torch.__version__,
            "grid_points": len(grid), "seconds": round(time.perf_counter() - started, 1),
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    fitted = fit_profile(measurements, shape, cluster, intra_node_bw=bandwidth, collective_latency_s=latency,
                         meta=meta)
    report = score_profile(fitted, measurements, shape, cluster)
    report["meta"] = meta
    report["fitted_points"] = [m.to_json() for m in measurements if not m.held_back]
    if is_logging_rank:
        written = scaled_to_stage(fitted, profiled_layers=shape.num_layers, layers_per_stage=profile.trained_layers)
        written["meta"] = {**meta, "median_rel_error": report["median_rel_error"],
                           "max_rel_error": report["max_rel_error"]}
        _write_json(profile.out, written)
        if profile.report:
            _write_json(profile.report, report)
        print(format_report(report), flush=True)
        print(f"dcp-profile: wrote {profile.out}" + (f" and {profile.report}" if profile.report else "") +
              f" ({len(grid)} grid points in {meta['seconds']:.0f} s; profiled {shape.num_layers} layers, "
              f"scaled to {profile.trained_layers})", flush=True)
    dist.barrier()
    return report


def _write_json(path: str, obj: dict) -> None:
    import os

    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)
