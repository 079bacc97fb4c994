"""`slow`: runs CI adds after the suite (`make test-slow`); `make test` deselects them.

`DCP_TEST_PROFILE=FILE` appends one JSON line per test phase: wall seconds and CPU seconds of the pytest process
plus every child it waited for (torchrun agents and their ranks, spawned gloo ranks). CPU seconds do not grow when
the machine is busy, so a profile taken beside other work still says where the suite's work goes;
`tools/test_profile.py FILE` sums it per file.
"""
from __future__ import annotations

import json
import os
import resource
import time

import pytest

# Megatron decorates its fusions with torch.compile (megatron.core.jit); on a CPU every rank of every launch then
# builds and loads inductor C++ kernels (~3 s per rank with a warm cache, more on a fresh machine: measured in
# docs/benchmarks.md). The suite runs them eagerly: every run and its reference alike, so parity is unaffected. Set
# before torch is imported here; launches and spawned ranks inherit it. TORCH_COMPILE_DISABLE=0 keeps compiling.
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

_PROFILE = os.environ.get("DCP_TEST_PROFILE")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long runs (3,000 hypothesis examples, 4-8 rank launches); "
                                       "make test-slow")


def _cpu_s() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


if _PROFILE:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        wall, cpu = time.monotonic(), _cpu_s()
        yield
        record = {"test": item.nodeid, "wall_s": round(time.monotonic() - wall, 3),
                  "cpu_s": round(_cpu_s() - cpu, 3), "worker": os.environ.get("PYTEST_XDIST_WORKER", "main")}
        with open(_PROFILE, "a") as f:
            f.write(json.dumps(record) + "\n")
