"""A training loop's heartbeat, and the one line both engines end with when a collective times out.

A collective that times out says only that a peer did not answer. Around its loop each engine (Megatron's
patched `train()`, the DeepSpeed trainer) holds a `CollectiveWatch`: every rank beats into the rendezvous store
(dcp_megatron/runtime/heartbeat.py) while it trains, and a timeout becomes one line naming where the run was,
after how long, and which rank stopped answering, then exit status 1 instead of a traceback per rank.
"""
from __future__ import annotations

import sys
from collections.abc import Callable

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
        message = timeout_message(self.heartbeat, rank=self.rank, where=where, timeout_minutes=self.timeout_minutes)
        print(f"{prefix}{message} ({str(err).splitlines()[0][:200]})", file=sys.stderr, flush=True)
        raise SystemExit(1) from err
