"""Training runs measured under the same conditions: alternating blocks of steps.

Every run starts once and stays alive; only one runs at a time. Each is paused (SIGSTOP to
torchrun and every process below it: its ranks, each in a process group of its own, and their
data-loader workers) after a block of steps and the next resumes for the
same steps, in turn (the demo runs three), so a change in the machine's load lands in every run's blocks
alike, and all train the same global batches in the same order. A step whose wall-time interval contains a pause is left
out (its time includes the pause); the step times are Megatron's own "elapsed time per iteration".
"""
from __future__ import annotations

import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field


@dataclass
class Step:
    ms: float              # Megatron's elapsed time per iteration
    loss: float
    arrived_s: float       # when its iteration line arrived (perf_counter)
    predicted_ms: float | None = None
    plan: str = ""


@dataclass
class PausedRun:
    """One training process that runs in blocks (see the module docstring)."""

    label: str
    cmd: list[str]
    env: dict
    cwd: str
    parse_iteration: object        # line -> (iteration, ms, loss, total) or None
    parse_plan: object             # line -> (iteration, predicted_ms, plan text) or None
    steps: dict[int, Step] = field(default_factory=dict)
    pauses: list[tuple[float, float]] = field(default_factory=list)
    tail: list[str] = field(default_factory=list)
    on_step: object = None          # callback(label, iteration, Step) as steps arrive

    def start(self) -> None:
        self._seen = threading.Condition()
        self._plans: dict[int, tuple[float, str]] = {}
        self._last_line_s = time.perf_counter()
        self._paused_at = None
        self.proc = subprocess.Popen(self.cmd, cwd=self.cwd, env=self.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            now = time.perf_counter()
            self.tail = (self.tail + [line])[-60:]
            plan = self.parse_plan(line)
            if plan:
                self._plans[plan[0]] = (plan[1], plan[2])
            done = self.parse_iteration(line)
            if done:
                it, ms, loss = done
                predicted, text = self._plans.get(it, (None, ""))
                step = Step(ms=ms, loss=loss, arrived_s=now, predicted_ms=predicted, plan=text)
                with self._seen:
                    self.steps[it] = step
                    self._seen.notify_all()
                if self.on_step is not None:
                    self.on_step(self.label, it, step)
        with self._seen:
            self._seen.notify_all()

    def run_until(self, iteration: int, timeout_s: float = 1800) -> None:
        """Resume (if paused), wait until `iteration` is reported or the process ends, pause again."""
        self._resume()
        deadline = time.monotonic() + timeout_s
        with self._seen:
            while iteration not in self.steps and self.proc.poll() is None:
                if not self._seen.wait(timeout=max(0.0, min(5.0, deadline - time.monotonic()))) \
                        and time.monotonic() > deadline:
                    raise SystemExit(f"demo: the {self.label} run reported no iteration {iteration} in {timeout_s:.0f} s")
        if self.proc.poll() is None:
            self._pause()

    def _signal_tree(self, sig: int) -> None:
        import psutil   # a DeepSpeed dependency, so in the demo's environment

        try:
            root = psutil.Process(self.proc.pid)
            for process in [root, *root.children(recursive=True)]:
                try:
                    process.send_signal(sig)
                except psutil.NoSuchProcess:
                    pass
        except psutil.NoSuchProcess:
            pass

    def _pause(self) -> None:
        self._signal_tree(signal.SIGSTOP)
        self._paused_at = time.perf_counter()

    def _resume(self) -> None:
        if self._paused_at is not None:
            self._signal_tree(signal.SIGCONT)
            self.pauses.append((self._paused_at, time.perf_counter()))
            self._paused_at = None

    def finish(self, timeout_s: float = 1800) -> int:
        self._resume()
        code = self.proc.wait(timeout=timeout_s)
        self._reader.join(timeout=30)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self._resume()
            self._signal_tree(signal.SIGKILL)

    def clean_steps(self) -> dict[int, Step]:
        """Steps whose interval (previous iteration line -> this one) contains no pause."""
        out, previous = {}, None
        for it in sorted(self.steps):
            step = self.steps[it]
            if previous is not None and not any(previous < end and start < step.arrived_s
                                                for start, end in self.pauses):
                out[it] = step
            previous = step.arrived_s
        return out


def alternate(runs: list[PausedRun], *, total_steps: int, block: int) -> None:
    """Start every run, then let each run `block` steps in turn until all reach `total_steps`."""
    try:
        for run in runs:                 # one at a time, so start-up (imports, dataset) does not overlap
            run.start()
            run.run_until(1)
        upto = 1
        while upto < total_steps:
            upto = min(total_steps, upto + block)
            for run in runs:
                run.run_until(upto)
        for run in runs:
            if run.finish() != 0:
                raise SystemExit(f"demo: the {run.label} run failed (exit {run.proc.returncode}):\n"
                                 + "".join(run.tail))
    finally:
        for run in runs:
            run.kill()


def common_steps(runs: list[PausedRun], *, skip: int) -> list[int]:
    """The steps after `skip` measured cleanly in every run."""
    clean = [set(run.clean_steps()) for run in runs]
    common = sorted(set.intersection(*clean)) if clean else []
    return [it for it in common if it > skip]


def block_ratios(fast: PausedRun, slow: PausedRun, *, steps: list[int], block: int) -> tuple[float, list[float]]:
    """slow's time / fast's time over `steps` (common_steps of all runs compared), overall and per block."""
    if not steps:
        raise SystemExit("demo: no step was measured cleanly in every run; raise --steps")
    per_block: dict[int, list[int]] = {}
    for it in steps:
        per_block.setdefault((it - 2) // block, []).append(it)
    a, b = fast.steps, slow.steps
    ratios = [sum(b[i].ms for i in its) / sum(a[i].ms for i in its) for its in per_block.values()]
    return sum(b[i].ms for i in steps) / sum(a[i].ms for i in steps), ratios
