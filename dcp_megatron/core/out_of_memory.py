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
from dataclasses import asdict, dataclass, replace

LIMIT_DIR = "dcp_memory_limits"
LIMIT_HEADROOM = 0.95       # a resumed run plans each micro-batch at most this fraction of the count that failed
INJECT_FLAG = "--dcp-inject-out-of-memory-at"
GiB = 1 << 30


@dataclass(frozen=True, kw_only=True)
class OutOfMemory:
    """One micro-batch that ran out of memory."""

    iteration: int
    rank: int                 # global rank
    microbatch_index: int     # its place among the rank's micro-batches of the step (plan order, fillers last)
    num_tokens: int           # the micro-batch's tokens (all its documents, before the CP split)
    cp_size: int
    relief: str               # what the plan chose for it: none, mlp, core_attn+mlp, full2, ...
    counted_bytes: int        # the planner's count for it (model states included), what the budget was held to
    budget_bytes: int         # the usable budget it was planned under (the safety margin taken off)
    peak_bytes: int | None    # the allocator's peak of the step so far (GPU); None where not measured

    def line(self) -> str:
        peak = ("not measured (no GPU)" if self.peak_bytes is None
                else f"measured peak {self.peak_bytes / GiB:.3f} GiB")
        return (f"rank {self.rank}, iteration {self.iteration}: out of memory in micro-batch "
                f"{self.microbatch_index} ({self.num_tokens} tokens, CP {self.cp_size}, relief {self.relief}): "
                f"counted {self.counted_bytes / GiB:.3f} GiB of a {self.budget_bytes / GiB:.3f} GiB budget, {peak}")

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
        self._inject_at = inject_at

    def __iter__(self):
        for index, batch in enumerate(list.__iter__(self)):
            self.started = index if self.started is None else max(self.started, index)
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
             budget_bytes: int, static_bytes: int) -> OutOfMemory:
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
                       peak_bytes=torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None)


def record(directory: str, event: OutOfMemory) -> str:
    """Write the event under `directory`/dcp_memory_limits/ (its own file: ranks failing together never race) and
    return its path. Written to a temporary name and renamed, so a reader never sees half a record."""
    folder = os.path.join(directory, LIMIT_DIR)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"iteration{event.iteration}-rank{event.rank}.json")
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
    """The smallest count that failed: what every micro-batch is planned under (with `LIMIT_HEADROOM`)."""
    return min((e.counted_bytes for e in events), default=None)


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
    limit = limit_bytes(events)
    if limit is None:
        return config, None
    first = min(events, key=lambda e: e.counted_bytes)
    note = (f"dcp: {len(events)} out-of-memory record(s) under {LIMIT_DIR}/ (smallest: iteration {first.iteration}, "
            f"rank {first.rank}, counted {limit / GiB:.3f} GiB): every micro-batch is planned under "
            f"{LIMIT_HEADROOM * limit / GiB:.3f} GiB")
    return replace(config, memory_limit_bytes=limit), note
