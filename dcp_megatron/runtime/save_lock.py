"""One run per checkpoint directory: a lock file in `--save` that names the run holding it.

Two runs started on one `--save` both save `iter_*` directories and the tracker, each replacing the other's,
and every checkpoint verifies: nothing says the run you resume is not the one you trained. A run that saves
holds `<save>/.dcp-save.lock` (JSON: host, pid, the pid's start time, when the run started, a random token).

- Only global rank 0 takes the lock (one writer per job, on any number of nodes). Under torchrun it posts its
  verdict in the launcher's rendezvous store and every other rank waits for it, so the whole job refuses
  together, each rank with the same one line; without that store rank 0's exit ends the job.
- A crashed run must not block its resume: a lock is stale when its host is this host and its pid is gone (or
  is another process now: the pid's start time differs), or, from another host, when the holder stopped
  refreshing it (a daemon thread touches it every REFRESH_S; stale after STALE_AFTER_S without a touch).
- Taken with O_EXCL (one of two simultaneous starts wins); a stale lock is replaced by a rename and read back,
  so of two runs replacing one stale lock at once the one whose token is not there backs off.
- Released when the process exits normally (atexit); a killed run leaves it, stale by the rules above. The
  process holding it may take it again (start-up checks run twice in one process, e.g. in tests).
"""
from __future__ import annotations

import atexit
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass

LOCK_FILE = ".dcp-save.lock"
REFRESH_S = 30.0
STALE_AFTER_S = 300.0    # ten missed refreshes: the holder on another host is gone
VERDICT_TIMEOUT_S = 300.0
_OK = "ok"


class SaveDirInUse(ValueError):
    """Another live run holds the checkpoint directory."""


@dataclass(frozen=True, kw_only=True)
class LockHolder:
    host: str
    pid: int
    pid_start: str | None    # /proc/<pid>/stat start time (ticks since boot): tells a reused pid apart
    started: str              # when the run took the lock (UTC, ISO 8601)
    token: str

    def describe(self) -> str:
        return f"host {self.host}, pid {self.pid}, started {self.started}"


def _pid_start(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _pid_alive(pid: int, pid_start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass   # alive, someone else's
    now = _pid_start(pid)
    return pid_start is None or now is None or now == pid_start


def _read_holder(path: str) -> LockHolder | None:
    try:
        with open(path) as f:
            return LockHolder(**json.load(f))
    except (OSError, ValueError, TypeError):
        return None   # gone, or half-written by a process killed while writing: no live holder proven


def is_stale(path: str, holder: LockHolder | None, *, host: str, now: float) -> bool:
    if holder is None:
        return True
    if holder.host == host:
        return not _pid_alive(holder.pid, holder.pid_start)
    try:
        return now - os.path.getmtime(path) > STALE_AFTER_S
    except OSError:
        return True


class SaveDirLock:
    """The lock of one checkpoint directory, held by this process once `acquire` returned."""

    def __init__(self, directory: str, *, flag: str = "--save") -> None:
        self.directory, self.flag = directory, flag
        self.path = os.path.join(directory, LOCK_FILE)
        self.holder = LockHolder(host=socket.gethostname(), pid=os.getpid(), pid_start=_pid_start(os.getpid()),
                                 started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), token=uuid.uuid4().hex)
        self._stop = threading.Event()

    def acquire(self) -> "SaveDirLock":
        """Hold the directory (creating it), replacing a stale lock; SaveDirInUse naming a live holder."""
        os.makedirs(self.directory, exist_ok=True)
        text = json.dumps(asdict(self.holder))
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            other = _read_holder(self.path)
            this_process = other is not None and (other.host, other.pid) == (self.holder.host, self.holder.pid)
            if not this_process and not is_stale(self.path, other, host=self.holder.host, now=time.time()):
                raise self._in_use(other) from None
            temporary = f"{self.path}.{self.holder.token}"
            with open(temporary, "w") as f:
                f.write(text)
            os.replace(temporary, self.path)
            if getattr(_read_holder(self.path), "token", None) != self.holder.token:
                raise self._in_use(_read_holder(self.path)) from None
            if other is not None and not this_process:
                print(f"dcp: {self.flag} {self.directory}: replacing the stale lock of a run that is gone "
                      f"({other.describe()})", flush=True)
        else:
            with os.fdopen(fd, "w") as f:
                f.write(text)
        atexit.register(self.release)
        threading.Thread(target=self._refresh, name="dcp-save-lock", daemon=True).start()
        return self

    def _in_use(self, other: LockHolder | None) -> SaveDirInUse:
        who = other.describe() if other is not None else "unknown"
        return SaveDirInUse(
            f"{self.flag} {self.directory} is held by another run ({who}): two runs saving to one directory "
            f"overwrite each other's checkpoints; give this run another {self.flag}, or wait for that run to end "
            f"(if it is gone, delete {self.path})")

    def _owned(self) -> bool:
        return getattr(_read_holder(self.path), "token", None) == self.holder.token

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_S):
            try:
                if self._owned():
                    os.utime(self.path)
            except OSError:
                pass   # the directory went away or is unreachable for a moment: the next refresh retries

    def release(self) -> None:
        self._stop.set()
        try:
            if self._owned():
                os.remove(self.path)
        except OSError:
            pass


def hold_save_dir(directory: str, *, flag: str = "--save", rank: int | None = None) -> SaveDirLock | None:
    """Rank 0 takes the lock of `directory`; every rank raises SaveDirInUse when it is held (see the docstring).
    Returns the lock on rank 0, None elsewhere."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    store = _agent_store()
    key = f"dcp_save_lock/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if rank != 0:
        if store is not None:
            verdict = store.get(key).decode()
            if verdict != _OK:
                raise SaveDirInUse(verdict)
        return None
    try:
        lock = SaveDirLock(directory, flag=flag).acquire()
    except SaveDirInUse as err:
        if store is not None:
            store.set(key, str(err))
        raise
    if store is not None:
        store.set(key, _OK)
    return lock


def _agent_store():
    """torchrun's rendezvous store, where the agent hosts it for its workers (else None)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    from dcp_megatron.runtime.heartbeat import connect_store

    return connect_store(timeout_s=VERDICT_TIMEOUT_S)
