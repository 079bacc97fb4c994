"""A pass that runs out of memory leaves the emulated device (runtime/device_ceiling.py) with the live bytes it had
before the pass: nothing of the failed pass's graph outlives it (issue 44, the memory probe's out-of-memory).

Two holders the garbage collector cannot see: the CPU memory reading's saved-tensor hook (runtime/memory_probe.py,
`SavedBytes`) returning the tensor itself tied each output a node saves to its own grad_fn, a cycle through C++,
so a forward that raised kept its whole graph; and a backward that raised leaves the nodes queued behind the
failing one in the thread's ready queue (runtime/backward_queue.py) until another backward pops them."""
from __future__ import annotations

import gc

import pytest
import torch

from dcp_megatron.runtime.backward_queue import BackwardQueueSentinel
from dcp_megatron.runtime.device_ceiling import DeviceCeiling
from dcp_megatron.runtime.measured_memory import SavedReadings

UNLIMITED = 1 << 40


def _weights():
    torch.manual_seed(0)
    return [torch.randn(128, 128, requires_grad=True) for _ in range(3)], torch.randn(256, 128)


def _forward(weights, x):
    """Nodes that save their own outputs (tanh, sigmoid) on two branches joined at the loss."""
    h = torch.relu(x @ weights[0])
    a, b = h, h
    for _ in range(3):
        a = torch.tanh(a @ weights[1])
        b = torch.sigmoid(b @ weights[2])
    return (a @ weights[1]).sum() + (b @ weights[2]).sum()


def _growth(run) -> int:
    """How far `run` raises the live bytes above where it starts, on an unlimited device."""
    with DeviceCeiling(UNLIMITED) as ceiling:
        before = ceiling.live_bytes
        run()
        return ceiling.peak_bytes - before


def test_a_forward_that_runs_out_of_memory_under_the_cpu_reading_leaves_nothing_live():
    weights, x = _weights()
    reading = SavedReadings(weights)
    growth = _growth(lambda: reading.run_forward(lambda saved: _forward(weights, x)))
    with DeviceCeiling(UNLIMITED) as ceiling:
        gc.collect()
        before = ceiling.live_bytes
        ceiling.limit_bytes = before + growth // 2
        with pytest.raises(torch.OutOfMemoryError):
            SavedReadings(weights).run_forward(lambda saved: _forward(weights, x))
        ceiling.limit_bytes = UNLIMITED
        gc.collect()
        assert ceiling.live_bytes == before


def test_a_backward_that_runs_out_of_memory_leaves_nothing_live_once_its_queue_is_released():
    weights, x = _weights()

    def step():
        _forward(weights, x).backward()
        for weight in weights:
            weight.grad = None

    growth = _growth(step)
    with DeviceCeiling(UNLIMITED) as ceiling:
        gc.collect()
        before = ceiling.live_bytes
        sentinel = BackwardQueueSentinel()
        loss = _forward(weights, x)
        ceiling.limit_bytes = ceiling.live_bytes + (before + growth - ceiling.live_bytes) // 2
        with pytest.raises(torch.OutOfMemoryError):
            loss.backward()   # runs out part way through the backward
        ceiling.limit_bytes = UNLIMITED
        del loss
        for weight in weights:
            weight.grad = None
        sentinel.release()
        gc.collect()
        assert ceiling.live_bytes == before
