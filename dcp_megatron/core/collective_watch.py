"""A training loop's heartbeat, and the one line both engines end with when a collective times out.

A collective that times out says only that a peer did not answer. Around its loop each engine (Megatron's
patched `train()`, the DeepSpeed trainer) holds a `CollectiveWatch`: every rank beats into the rendezvous store
(dcp_megatron/runtime/heartbeat.py) while it trains, and a timeout becomes one line naming where the run was,
after how long, and which rank stopped answering, then exit status 1 instead of a traceback per rank. A planned
micro-batch that ran out of memory (core/out_of_memory.py) ends the run the same way: the rank it happened on
posts it in the store and records it beside the checkpoints, the ranks left waiting for it name it.
"""
from __future__ import annotations

import sys
from collections.abc import Callable

from dcp_megatron.core import out_of_memory
from dcp_megatron.runtime import heartbeat as heartbeats
from dcp_megatron.runtime.heartbeat import Heartbeat, is_collective_timeout, timeout_message


class CollectiveWatch:
    """`with CollectiveWatch(...) as watch:` beats while the loop runs; `watch.stop_on_timeout(err, ...)` in its
    error handler ends a timed-out run with the one line."""

    def __init__(self, *, rank: int, world_size: int, step_of: Callable[[], int], timeout_minutes: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.step_of = step_of            # the step this rank is in (what its beats report)
        self.timeout_minutes = timeout_minutes
        self.heartbeat: Heartbeat | None = None

    def __enter__(self) -> "CollectiveWatch":
        store = heartbeats.connect_store()   # looked up at start (tests run without a store)
        if store is not None:   # without a store (one process, plain python) a timeout says less
            self.heartbeat = Heartbeat(store, rank=self.rank, world_size=self.world_size,
                                       step_of=self.step_of).start()
        return self

    def __exit__(self, *exc) -> None:
        if self.heartbeat is not None:
            self.heartbeat.close()

    def stop_on_timeout(self, err: BaseException, *, where: str, prefix: str) -> None:
        """For a collective timeout: print `prefix` and the one line on stderr and raise SystemExit(1); for any
        other error return (the caller handles it)."""
        if not is_collective_timeout(err):
            return
        event = self._posted_out_of_memory()
        if event is not None:   # the peer this rank waited for ran out of memory and stopped
            print(f"{prefix}rank {self.rank}, {where}: stopped waiting for a collective; {event.line()}",
                  file=sys.stderr, flush=True)
            raise SystemExit(1) from err
        message = timeout_message(self.heartbeat, rank=self.rank, where=where, timeout_minutes=self.timeout_minutes)
        print(f"{prefix}{message} ({str(err).splitlines()[0][:200]})", file=sys.stderr, flush=True)
        raise SystemExit(1) from err

    def stop_on_out_of_memory(self, err: BaseException, *, save_dir: str | None, prefix: str,
                              event: out_of_memory.OutOfMemory | None = None) -> None:
        """Post the event (`err.event` of a MicrobatchOutOfMemory, else `event`) for the other ranks, record it in
        `save_dir` (when saving) and stop: one line on stderr, SystemExit(1). Nothing is saved: the last checkpoint
        stays the last good one, and a restart (torchrun --max-restarts, or the command typed again with --load)
        resumes from it under the record."""
        event = event if event is not None else err.event
        if self.heartbeat is not None:
            try:
                self.heartbeat.post("out_of_memory", event.to_json())
            except Exception:   # the store is gone (the job is ending): the line below still says it
                pass
        if save_dir and event.phase != out_of_memory.MICROBATCH:
            where = out_of_memory.record(save_dir, event)
            then = (f"recorded in {where} (a restart stops after {out_of_memory.MAX_EVENTS_PER_STEP} at one "
                    f"iteration)")
        elif save_dir:
            where = out_of_memory.record(save_dir, event)
            then = (f"recorded in {where}: the same command resumed from the last checkpoint (torchrun "
                    f"--max-restarts restarts it) plans every micro-batch under {out_of_memory.LIMIT_HEADROOM:g} x "
                    f"its limit")
        else:
            then = "not recorded (no --save): lower --dcp-memory-budget-gb below its count"
        print(f"{prefix}{event.line()}; the run stops here, nothing saved; {then}", file=sys.stderr, flush=True)
        raise SystemExit(1) from err

    def _posted_out_of_memory(self) -> out_of_memory.OutOfMemory | None:
        if self.heartbeat is None:
            return None
        try:
            text = self.heartbeat.read_post("out_of_memory")
        except Exception:   # the store is gone
            return None
        return None if text is None else out_of_memory.OutOfMemory.from_json(text)
