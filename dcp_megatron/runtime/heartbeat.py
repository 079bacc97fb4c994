"""Which rank stopped answering, when a collective times out.

A collective that times out (gloo: "Timed out waiting ...ms", NCCL: the watchdog) says that a peer did
not answer, not which one. Every rank runs a `Heartbeat`: a daemon thread that bumps a counter and
records the rank's step in the rendezvous store (the launcher's TCP store, which outlives any worker)
every `interval_s`. After a timeout the survivors read the counters twice, a few intervals apart:
a rank whose counter stood still is stopped (SIGSTOP, a frozen host) or its process is gone; a rank
still beating but at an earlier step is hung in its own code. Counters, not clocks, so hosts need not
agree on the time. Nothing here runs on the training path: the step is read by the beating thread,
which looks at it every `poll_s` (a few ms) and records a new step at once, so a rank stopped right
after finishing a step is reported at that step, not at the step of its last periodic beat (with a beat
every 2 s and sub-second steps that lagged 1-3 steps behind).
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

_PREFIX = "dcp_heartbeat"


@dataclass(frozen=True, kw_only=True)
class Silence:
    rank: int
    step: int | None      # the last step it reported; None if never heard
    stopped: bool         # True: no beat at all during the check; False: beating but behind


def connect_store(timeout_s: float = 30.0):
    """A client of the rendezvous store torchrun / deepspeed set up (MASTER_ADDR/PORT), None without one."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    import torch.distributed as dist

    try:
        return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s),
                             wait_for_workers=False)
    except (RuntimeError, OSError):   # no store to beat into: a timeout then says less, nothing else changes
        return None


class Heartbeat:
    def __init__(self, store, *, rank: int, world_size: int, step_of: Callable[[], int], interval_s: float = 2.0,
                 poll_s: float = 0.01):
        if interval_s <= 0 or poll_s <= 0:
            raise ValueError(f"interval_s and poll_s must be positive, got {interval_s} and {poll_s}")
        self.store, self.rank, self.world_size, self.interval_s = store, rank, world_size, interval_s
        self.poll_s = min(poll_s, interval_s)
        self.step_of = step_of   # the step this rank is in (e.g. the loop's iteration counter)
        self._beats = 0
        self._step = None        # the step the last beat recorded
        self._lock = threading.Lock()   # the store client is used from the beating thread and the caller
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dcp-heartbeat", daemon=True)
        self._generation = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # a restarted job starts afresh

    def start(self) -> "Heartbeat":
        self._beat()
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()

    def _key(self, rank: int) -> str:
        return f"{_PREFIX}/{self._generation}/{rank}"

    def _beat(self, step: int | None = None) -> None:
        self._beats += 1
        self._step = int(self.step_of()) if step is None else step
        with self._lock:
            self.store.set(self._key(self.rank), f"{self._beats} {self._step}")

    def _run(self) -> None:
        last_beat = time.monotonic()
        while not self._stop.wait(self.poll_s):
            step = int(self.step_of())
            if step == self._step and time.monotonic() - last_beat < self.interval_s:
                continue
            try:
                self._beat(step)   # a new step is recorded at once; otherwise one beat per interval
            except Exception:   # the store is gone: the job is ending; nothing to report to
                return
            last_beat = time.monotonic()

    def post(self, name: str, text: str) -> None:
        """Leave `text` in the store under `name` for every rank to read (e.g. why this rank stops)."""
        with self._lock:
            self.store.set(f"{_PREFIX}/{self._generation}/post/{name}", text)

    def read_post(self, name: str) -> str | None:
        """What a rank posted under `name`, None if nothing was."""
        key = f"{_PREFIX}/{self._generation}/post/{name}"
        with self._lock:
            return self.store.get(key).decode() if self.store.check([key]) else None

    def _read(self) -> dict[int, tuple[int, int]]:
        keys = [self._key(r) for r in range(self.world_size)]
        with self._lock:
            present = [k for k in keys if self.store.check([k])]
            values = self.store.multi_get(present) if present else []
        out = {}
        for key, value in zip(present, values):
            beats, step = value.decode().split()
            out[int(key.rsplit("/", 1)[1])] = (int(beats), int(step))
        return out

    def silent_ranks(self, *, my_step: int, intervals: float = 3.0) -> list[Silence]:
        """Ranks other than this one that stopped beating, or beat at an earlier step than `my_step`."""
        first = self._read()
        time.sleep(intervals * self.interval_s)
        second = self._read()
        silent = []
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            if rank not in second or second[rank][0] == first.get(rank, (None,))[0]:
                silent.append(Silence(rank=rank, step=second.get(rank, (0, None))[1], stopped=True))
            elif second[rank][1] < my_step:
                silent.append(Silence(rank=rank, step=second[rank][1], stopped=False))
        return silent


def describe_silence(silent: list[Silence]) -> str:
    if not silent:
        return "every other rank is still beating at this step (the stall is inside the collective library)"
    parts = []
    for s in silent:
        where = f"last heartbeat in step {s.step}" if s.step is not None else "never heard"
        parts.append(f"rank {s.rank} ({'stopped or dead' if s.stopped else 'alive but behind'}, {where})")
    return "not answering: " + ", ".join(parts)


def is_collective_timeout(err: BaseException) -> bool:
    """A collective or store operation that gave up waiting for a peer (gloo, NCCL watchdog, TCP store)."""
    text = str(err).lower()
    return isinstance(err, RuntimeError) and ("timed out" in text or "timeout" in text)


def timeout_message(heartbeat: Heartbeat | None, *, rank: int, where: str, timeout_minutes: float) -> str:
    """One line for a collective that timed out: where (e.g. "iteration 7"), after how long, and who stopped
    answering."""
    who = "peers unknown (no heartbeat store)"
    if heartbeat is not None:
        try:
            who = describe_silence(heartbeat.silent_ranks(my_step=heartbeat.step_of()))
        except Exception as err:   # the store lives in a stopped process (e.g. rank 0 without torchrun's agent)
            who = f"peers unknown (the heartbeat store did not answer: {str(err).splitlines()[0][:120]})"
    return (f"rank {rank}, {where}: a collective did not complete within --distributed-timeout-minutes "
            f"{timeout_minutes:g}; {who}. The run stops here; the latest checkpoint is the last good one")
