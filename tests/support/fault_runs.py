"""Launch a real training run under torchrun, hit one process with a signal when a line appears, and record
when each process ended.

`run_with_fault(command, trigger=..., victim=..., sig=...)`: the run's output is read line by line with
timestamps; when `trigger` appears, `sig` goes to the victim (a worker by local rank, or the torchrun
agent). The result says when the first line containing some text came (`seconds_to`), when every other
worker had exited (`survivors_gone_s`) and when torchrun itself exited, all measured from the signal.
After the survivors are gone, `stop_after_survivors_s` lets the test end a job that torchrun would keep
waiting on (its 30 s grace for a SIGSTOPped worker before SIGKILL) without waiting out the grace. At the
end every worker's process group is killed: a SIGSTOPped worker, and the processes a kill -9'd worker
leaves behind (megatron-core's checkpoint writer processes outlive it and hold the output pipe open).
"""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field

from tests.support.megatron_runs import REPO, run_env


@dataclass
class FaultRun:
    returncode: int | None
    output: str
    victim_pid: int
    worker_pids: list[int]
    lines: list[tuple[float, str]] = field(default_factory=list)   # (seconds after the signal, line)
    survivors_gone_s: float | None = None
    agent_exit_s: float | None = None

    def seconds_to(self, text: str) -> float | None:
        return next((t for t, line in self.lines if text in line and t >= 0), None)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _reader(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put((time.monotonic(), line))
    out.put((time.monotonic(), None))


def run_with_fault(command: list[str], *, trigger: str, victim: int | str, sig: int, timeout_s: float = 300,
                   env: dict | None = None, stop_after_survivors_s: float | None = None) -> FaultRun:
    """`victim`: a local rank (its worker process) or "agent" (torchrun)."""
    agent = subprocess.Popen(command, cwd=REPO, env=env or run_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(agent.stdout, lines), daemon=True).start()
    seen: list[tuple[float, str]] = []
    deadline = time.monotonic() + timeout_s
    fault_at = workers = victim_pid = None
    survivors_gone = agent_exit = None
    try:
        while time.monotonic() < deadline:
            try:
                at, line = lines.get(timeout=0.2)
            except queue.Empty:
                at, line = time.monotonic(), ""
            if line is None:
                break
            if line:
                seen.append((at, line))
            if fault_at is None and trigger in line:
                workers = sorted(int(p) for p in subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True,
                                                                 text=True).stdout.split())
                victim_pid = agent.pid if victim == "agent" else workers[victim]
                os.kill(victim_pid, sig)
                fault_at = time.monotonic()
            if fault_at is not None:
                now = time.monotonic()
                others = [p for p in workers if p != victim_pid]
                if survivors_gone is None and not any(_alive(p) for p in others):
                    survivors_gone = now - fault_at
                if agent_exit is None and agent.poll() is not None:
                    agent_exit = now - fault_at
                # Processes a killed worker leaves behind (e.g. checkpoint writers) may hold the output open.
                if agent_exit is not None and now - fault_at > agent_exit + 2:
                    break
                if (survivors_gone is not None and stop_after_survivors_s is not None
                        and now - fault_at > survivors_gone + stop_after_survivors_s):
                    break
        if fault_at is not None and agent_exit is None and line is None:   # the output ended first
            try:
                agent.wait(timeout=30)
                agent_exit = time.monotonic() - fault_at
            except subprocess.TimeoutExpired:
                pass
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
        for pid in workers or []:   # each worker leads its own process group: it and what it left behind
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    while not lines.empty():
        at, line = lines.get()
        if line:
            seen.append((at, line))
    base = fault_at if fault_at is not None else 0.0
    return FaultRun(returncode=agent.returncode, output="".join(line for _, line in seen),
                    victim_pid=victim_pid or -1, worker_pids=workers or [],
                    lines=[(at - base, line) for at, line in seen], survivors_gone_s=survivors_gone,
                    agent_exit_s=agent_exit)
