"""An out-of-memory in a planned micro-batch: one line naming it, a limit kept beside the checkpoints, a resume
that plans under it.

Every plan is packed to the memory budget by the planner's count, so a micro-batch that still runs out of memory
means the count was low for it. The step loop catches `torch.OutOfMemoryError` around the engine's run and raises
`MicrobatchOutOfMemory`: which micro-batch of this rank was running (the engine takes them from a
`TrackedBatches` list), its tokens, CP size and relief, the bytes the planner counted for it, the budget and, on a
GPU, the allocator's peak. The engine's loop (inside its `CollectiveWatch`) then
- posts the event in the rendezvous store, so ranks left waiting in a collective with it name it when their
  collective times out instead of a silent peer;
- records it in `--save`'s directory (`dcp_memory_limits/`, one file per event, next to the checkpoints, never
  over them: nothing saved is lost or rewritten);
- stops with one line and exit status 1, saving nothing.
The same command resumed from the last checkpoint reads the records (`--load` and `--save` directories): the
planner then keeps every micro-batch's count below `LIMIT_HEADROOM` times the smallest count that failed, so the
micro-batch that ran out gets more relief or a larger CP group (`capped_memory_bytes`).

Fault injection: `--dcp-inject-out-of-memory-at <iteration>:<rank>:<micro-batch>` (DcpConfig.inject_out_of_memory_at)
raises the error when that rank's engine takes that micro-batch of that iteration (global rank, 0-based micro-batch
index in plan order).
"""
from __future__ import annotations

import glob
import json
import math
import os
import socket
from dataclasses import asdict, dataclass, replace

LIMIT_DIR = "dcp_memory_limits"
LIMIT_HEADROOM = 0.95       # a resumed run plans each micro-batch at most this fraction of the count that failed
INJECT_FLAG = "--dcp-inject-out-of-memory-at"
GiB = 1 << 30


MICROBATCH = "micro-batch"           # a planned micro-batch's forward or backward: the planner's count was low
OPTIMIZER = "optimizer step"
EVALUATION = "evaluation"
PROBE = "memory probe"
OUTSIDE = "training step"            # elsewhere in a step (neither a planned micro-batch nor the above)
# advice per phase: what lowers it (only a micro-batch's is the activation budget, which the record lowers)
ADVICE = {
    OPTIMIZER: "the optimizer's states and update do not fit beside the model: shard them (--use-distributed-optimizer "
               "on Megatron, ZeRO stage >= 1 on DeepSpeed) or give the run more memory; a lower activation budget "
               "does not help",
    EVALUATION: "evaluation runs the engine's own micro-batches (--micro-batch-size x --seq-length tokens), not DCP's "
                "plans: lower --micro-batch-size or give the run more memory; a lower activation budget does not help",
    PROBE: "the memory probe's largest micro-batch did not fit: its relief's count is raised and the run goes on",
    OUTSIDE: "not in a planned micro-batch: a lower activation budget may not help",
}
MAX_EVENTS_PER_STEP = 4   # runs (attempts) that ran out of memory at one iteration before the run stops at start


def this_run() -> str:
    """Which run writes a record: torchrun's run id and restart count (the same on every rank of one attempt),
    else this process."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is not None:
        return f"torchrun {run_id} restart {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return f"pid {os.getpid()} on {socket.gethostname()}"


@dataclass(frozen=True, kw_only=True)
class OutOfMemory:
    """One out-of-memory: in a planned micro-batch (`phase` MICROBATCH) or elsewhere (the other phases)."""

    iteration: int
    rank: int                 # global rank
    microbatch_index: int     # its place among the rank's micro-batches of the step (plan order, fillers last)
    num_tokens: int           # the micro-batch's tokens (all its documents, before the CP split)
    cp_size: int
    relief: str               # what the plan chose for it: none, mlp, core_attn+mlp, full2, ...
    counted_bytes: int        # the planner's count for it (model states included), what the budget was held to
    budget_bytes: int         # the usable budget it was planned under (the safety margin taken off)
    peak_bytes: int | None    # the allocator's peak of the step so far (GPU); None where not measured
    phase: str = MICROBATCH
    memory_factor: float = 1.0          # the memory count's factor for its relief then: counted_bytes includes it
    device_bytes: int | None = None     # the device's memory (--dcp-device-memory-gb's emulated one on CPU)
    attempted_bytes: int | None = None  # the live bytes the failing allocation would have made (emulated device)
    run: str = ""                       # which run wrote it (this_run())
    live_at_start_bytes: int | None = None   # the emulated device's live bytes when the micro-batch was taken
    static_bytes: int | None = None          # the planner's count of the model states (part of counted_bytes)

    def line(self) -> str:
        if self.phase != MICROBATCH:
            return (f"rank {self.rank}, iteration {self.iteration}: out of memory in the {self.phase}"
                    f"{self._device_words()}: {ADVICE.get(self.phase, ADVICE[OUTSIDE])}")
        peak = ("not measured (no GPU)" if self.peak_bytes is None
                else f"measured peak {self.peak_bytes / GiB:.3f} GiB")
        return (f"rank {self.rank}, iteration {self.iteration}: out of memory in micro-batch "
                f"{self.microbatch_index} ({self.num_tokens} tokens, CP {self.cp_size}, relief {self.relief}): "
                f"counted {self.counted_bytes / GiB:.3f} GiB (memory factor x{self.memory_factor:.2f}) of a "
                f"{self.budget_bytes / GiB:.3f} GiB budget, {peak}{self._device_words()}")

    def _device_words(self) -> str:
        if self.device_bytes is None or self.attempted_bytes is None:
            return ""
        return (f" ({self.attempted_bytes / GiB:.4f} GiB live past the {self.device_bytes / GiB:.4f} GiB device)")

    def limit(self) -> int | None:
        """The count this event says no micro-batch may reach (None: not a micro-batch's): its count, scaled down by
        how far the live bytes went past the device where that is known (an emulated device) and at most the device,
        so a run planned far above its device converges in few events. (`live_at_start_bytes` is kept for the
        reader: a term subtracting what lived beyond the count's model states was tried and dropped, since what a
        failed probe pass leaves alive made it refuse every plan.)"""
        if self.phase != MICROBATCH:
            return None
        limit = float(self.counted_bytes)
        if self.device_bytes and self.attempted_bytes and self.attempted_bytes > self.device_bytes:
            limit *= self.device_bytes / self.attempted_bytes
        if self.device_bytes:   # no count fits above the device itself
            limit = min(limit, self.device_bytes)
        return max(1, int(limit))

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "OutOfMemory":
        return cls(**json.loads(text))


class MicrobatchOutOfMemory(RuntimeError):
    """A planned micro-batch ran out of memory (`event` says which); the engine's loop stops the run on it."""

    def __init__(self, event: OutOfMemory) -> None:
        super().__init__(event.line())
        self.event = event


class TrackedBatches(list):
    """This rank's micro-batch dicts as the engine iterates them: `started` is the index of the last one it took
    (the one running when an error comes). `inject_at`: the injected fault's micro-batch (--dcp-inject-out-of-memory-at), raised when taken."""

    def __init__(self, batches, *, inject_at: int | None = None) -> None:
        super().__init__(batches)
        self.started: int | None = None
        self.live_at_take: dict[int, int] = {}   # on an emulated device: its live bytes as each one was taken
        self._inject_at = inject_at

    def __iter__(self):
        from dcp_megatron.runtime.device_ceiling import active_ceiling

        ceiling = active_ceiling()
        for index, batch in enumerate(list.__iter__(self)):
            self.started = index if self.started is None else max(self.started, index)
            if ceiling is not None:
                self.live_at_take.setdefault(index, ceiling.live_bytes)
            if index == self._inject_at:
                import torch

                raise torch.OutOfMemoryError(f"injected by {INJECT_FLAG} at micro-batch {index}")
            yield batch


def injected_microbatch(iteration: int, rank: int, at: tuple[int, int, int] | None) -> int | None:
    """The micro-batch index `at` (DcpConfig.inject_out_of_memory_at) names for this iteration and rank, else None."""
    if at is None:
        return None
    at_iteration, at_rank, index = at
    return index if (at_iteration, at_rank) == (iteration, rank) else None


def describe(plan, batches: TrackedBatches, *, iteration: int, rank: int, domain_rank: int,
             budget_bytes: int, static_bytes: int, memory_scale=None) -> OutOfMemory:
    """The event for the micro-batch `batches` was running when this rank ran out of memory."""
    import torch

    from dcp_megatron.core.microbatch_facts import MICROBATCH_KEY

    index = batches.started or 0
    planned = [mb for _, group in plan.rank_schedule(domain_rank) for mb in group.microbatches]
    if index < len(planned):
        microbatch = planned[index]
        num_tokens, relief, counted = microbatch.num_tokens, str(microbatch.recompute), microbatch.est_mem_bytes
    else:   # a filler the engine added (virtual pipeline stages): no documents, the model states alone
        num_tokens, relief, counted = 0, "none", static_bytes
    facts = batches[index][MICROBATCH_KEY] if index < len(batches) else None
    return OutOfMemory(iteration=iteration, rank=rank, microbatch_index=index, num_tokens=int(num_tokens),
                       cp_size=facts.cp_size if facts is not None else 1, relief=relief,
                       counted_bytes=int(counted), budget_bytes=int(budget_bytes),
                       peak_bytes=torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
                       memory_factor=memory_scale.of(relief) if memory_scale is not None else 1.0,
                       **_device_fields(), run=this_run(), live_at_start_bytes=batches.live_at_take.get(index),
                       static_bytes=int(static_bytes))


def _device_fields() -> dict:
    from dcp_megatron.runtime.device_ceiling import active_ceiling

    ceiling = active_ceiling()
    if ceiling is None:
        return {}
    return {"device_bytes": ceiling.limit_bytes, "attempted_bytes": ceiling.attempted_bytes}


def phase_of(err: BaseException) -> str:
    """Where an out-of-memory came from, by the code it was raised in (the innermost match wins): the optimizer's
    step, an evaluation, the memory probe, else a planned micro-batch's forward/backward (MICROBATCH)."""
    import traceback

    found = MICROBATCH
    for frame in traceback.extract_tb(err.__traceback__):
        path = frame.filename.replace(os.sep, "/")
        if "/torch/optim/" in path or "/megatron/core/optimizer/" in path or frame.name in _OPTIMIZER_FUNCTIONS:
            found = OPTIMIZER
        elif (frame.name == "evaluate" and path.endswith("megatron/training/training.py")) or \
                path.endswith("dcp_megatron/deepspeed/evaluation.py"):
            found = EVALUATION
        elif path.endswith("dcp_megatron/training/memory_probe_run.py"):
            found = PROBE
    return found


# DeepSpeed's engine.step() and Megatron's optimizer entry (their code outside the optimizer packages)
_OPTIMIZER_FUNCTIONS = {"_take_model_step", "step_optimizer", "_step_optimizer"}


def outside_microbatch(err: BaseException, *, iteration: int, rank: int, phase: str | None = None) -> OutOfMemory:
    """The event for an out-of-memory outside a planned micro-batch (the optimizer step, an evaluation, ...)."""
    import torch

    return OutOfMemory(iteration=iteration, rank=rank, microbatch_index=-1, num_tokens=0, cp_size=1, relief="none",
                       counted_bytes=0, budget_bytes=0,
                       peak_bytes=torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
                       phase=phase or phase_of(err), **_device_fields(), run=this_run())


def record(directory: str, event: OutOfMemory) -> str:
    """Write the event under `directory`/dcp_memory_limits/ (its own file: ranks failing together never race) and
    return its path. Written to a temporary name and renamed, so a reader never sees half a record."""
    folder = os.path.join(directory, LIMIT_DIR)
    os.makedirs(folder, exist_ok=True)
    attempt = 0     # a restarted run failing at the same step adds its record beside the earlier one's
    while os.path.exists(path := os.path.join(folder, f"iteration{event.iteration}-rank{event.rank}-{attempt}.json")):
        attempt += 1
    temporary = f"{path}.tmp{os.getpid()}"
    with open(temporary, "w") as out:
        out.write(event.to_json() + "\n")
    os.replace(temporary, path)
    return path


def recorded(*directories: str | None) -> list[OutOfMemory]:
    """Every event recorded under the given directories (None and missing ones skipped; each file once)."""
    paths = sorted({os.path.realpath(p) for d in directories if d
                    for p in glob.glob(os.path.join(d, LIMIT_DIR, "*.json"))})
    events = []
    for path in paths:
        with open(path) as source:
            try:
                events.append(OutOfMemory.from_json(source.read()))
            except (ValueError, TypeError) as err:
                raise ValueError(f"{path}: not an out-of-memory record ({err}); remove it to plan without it") from None
    return events


def limit_bytes(events: list[OutOfMemory]) -> int | None:
    """The smallest limit of the micro-batches that failed (`OutOfMemory.limit`): what every micro-batch is planned
    under (with `LIMIT_HEADROOM`). Out-of-memory errors outside a micro-batch set no limit."""
    return min((e.limit() for e in events if e.limit() is not None), default=None)


def recorded_factors(events: list[OutOfMemory]) -> dict[str, float]:
    """The memory factor each failed relief was counted with (the largest per relief): a resumed run starts its
    memory count at them, so its counts are in the units the limit was recorded in."""
    out: dict[str, float] = {}
    for event in events:
        if event.phase == MICROBATCH and event.memory_factor != 1.0:
            out[event.relief] = max(out.get(event.relief, 1.0), event.memory_factor)
    return out


def check_retries(events: list[OutOfMemory], *, bound: int = MAX_EVENTS_PER_STEP) -> None:
    """Stop (DcpUsageError, one line) once `bound` runs ran out of memory at one iteration: restarting again would
    fail there again."""
    from dcp_megatron.config import DcpUsageError

    runs_at: dict[int, set] = {}
    for event in events:
        runs_at.setdefault(event.iteration, set()).add(event.run or f"rank {event.rank}")
    for iteration, runs in sorted(runs_at.items()):
        if len(runs) >= bound:
            last = [e for e in events if e.iteration == iteration][-1]
            raise DcpUsageError(f"{len(runs)} runs ran out of memory at iteration {iteration} (records under "
                                f"{LIMIT_DIR}/ beside the checkpoints; the last: {last.line()}); the run stops "
                                f"instead of restarting again: move {LIMIT_DIR}/ away once the cause is fixed")


def capped_memory_bytes(mem_bytes_per_gpu: int, *, safety_frac: float, limit: int | None) -> int:
    """The memory per rank the planner is given so that its usable part (the safety margin taken off) is at most
    `LIMIT_HEADROOM` x `limit`: the micro-batch that failed no longer fits as it was planned."""
    if limit is None:
        return mem_bytes_per_gpu
    return min(mem_bytes_per_gpu, math.floor(LIMIT_HEADROOM * limit / (1.0 - safety_frac)))


def under_recorded_limit(config, *directories: str | None):
    """(`config` with the limit of the events recorded under `directories`, the one line a resumed run prints about
    it or None when nothing is recorded)."""
    events = recorded(*directories)
    check_retries(events)
    limit = limit_bytes(events)
    if limit is None:
        return config, None
    first = min((e for e in events if e.limit() is not None), key=lambda e: e.limit())
    factors = recorded_factors(events)
    units = ("" if not factors else " (counts start at the recorded memory factors "
             + ", ".join(f"{relief} x{factor:.2f}" for relief, factor in sorted(factors.items())) + ")")
    note = (f"dcp: {len(events)} out-of-memory record(s) under {LIMIT_DIR}/ (smallest limit: iteration "
            f"{first.iteration}, rank {first.rank}, written by {first.run or 'an earlier run'}, "
            f"{limit / GiB:.4f} GiB): every micro-batch is planned under {LIMIT_HEADROOM * limit / GiB:.4f} GiB{units}")
    return replace(config, memory_limit_bytes=limit, recorded_memory_factors=tuple(sorted(factors.items()))), note
