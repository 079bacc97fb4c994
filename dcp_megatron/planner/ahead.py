"""Planning off the critical path: plan step k+1 on a worker thread while step k trains.

A step's lengths are known as soon as its samples are read, one step before it trains. The caller
submits step k+1's planning before it runs step k and asks for the plan when step k+1 starts;
the step waits on the planner only for what planning takes beyond step k's training (the exposed
time). The planner is pure Python/numpy and training releases the GIL while kernels or
collectives run, so the two overlap. The plan is the plan function's result for the same
arguments, computed the same way as synchronous planning: planning ahead changes when, never what.

One worker thread, one plan in flight: plans come back in submission order, and a planning error
is raised by `result()` of that step, in the caller's thread.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class PlannedStep:
    """A step's plan with how long planning took and how long the step waited for it."""

    step: int
    plan: Any
    plan_s: float        # wall time of the planning itself (on the worker thread)
    exposed_s: float     # time the caller waited in result(): planning not hidden behind training
    ahead: bool = True   # planned on the worker thread (False: on the caller's, all of it exposed)


class PlanAhead:
    """Plans one step ahead on a background thread (see the module docstring)."""

    def __init__(self, plan_function: Callable[..., Any]) -> None:
        self._plan_function = plan_function
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcp-plan-ahead")
        self._pending: dict[int, Future] = {}

    def submit(self, step: int, *args, **kwargs) -> None:
        """Start planning `step` now; its result is collected by `result(step)`."""
        if step in self._pending:
            raise ValueError(f"step {step} is already being planned")
        if self._pending:
            raise ValueError(f"step {min(self._pending)} is still pending: collect it before submitting step {step}")
        self._pending[step] = self._executor.submit(self._timed, *args, **kwargs)

    def pending(self, step: int) -> bool:
        return step in self._pending

    def result(self, step: int) -> PlannedStep:
        """The plan of `step` (submitted earlier), waiting for it if it is not done yet."""
        try:
            future = self._pending.pop(step)
        except KeyError:
            raise ValueError(f"step {step} was not submitted") from None
        waited = time.perf_counter()
        plan, plan_s = future.result()
        return PlannedStep(step=step, plan=plan, plan_s=plan_s, exposed_s=time.perf_counter() - waited)

    def discard(self) -> None:
        """Drop any plan in flight (the step it was for will not run as planned)."""
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()

    def close(self) -> None:
        self.discard()
        self._executor.shutdown(wait=True)

    def _timed(self, *args, **kwargs):
        started = time.perf_counter()
        plan = self._plan_function(*args, **kwargs)
        return plan, time.perf_counter() - started


def plan_synchronously(step: int, plan_function: Callable[..., Any], *args, **kwargs) -> PlannedStep:
    """The same record for a step planned on the caller's thread (all of it exposed)."""
    started = time.perf_counter()
    plan = plan_function(*args, **kwargs)
    elapsed = time.perf_counter() - started
    return PlannedStep(step=step, plan=plan, plan_s=elapsed, exposed_s=elapsed, ahead=False)
