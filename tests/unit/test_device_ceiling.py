"""The emulated device (runtime/device_ceiling.py): every live tensor byte counted as it lives, and the allocation
that crosses the ceiling raises torch.OutOfMemoryError where it happens: forward, backward, a recompute replayed
inside backward (reentrant or not), the optimizer step. Without the flag there is no mode at all."""
from __future__ import annotations

import contextlib
import gc
import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from dcp_megatron.core import out_of_memory as oom
from dcp_megatron.runtime.device_ceiling import DeviceCeiling, active_ceiling, emulated_device

UNLIMITED = 1 << 40


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))


def _step(model, x, recompute):
    if recompute is None:
        y = model(x)
    else:
        y = checkpoint(model, x, use_reentrant=recompute)
    y.square().sum().backward()


def _live_storages() -> int:
    seen = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        objects = gc.get_objects()
    for obj in objects:
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_sparse:
            storage = obj.untyped_storage()
            seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


def test_the_count_follows_what_lives_incrementally():
    model = _model()
    with DeviceCeiling(UNLIMITED) as ceiling:
        assert ceiling.live_bytes == _live_storages()   # what existed before: weights and the rest
        before = ceiling.live_bytes
        x = torch.randn(128, 64)
        view = x[1:]   # a view is its storage, once
        assert ceiling.live_bytes == before + x.untyped_storage().nbytes()
        del x, view
        gc.collect()
        assert ceiling.live_bytes == before
        _step(model, torch.randn(128, 64), None)
        assert ceiling.peak_bytes > ceiling.live_bytes >= before   # activations came and went; grads stay
        assert active_ceiling() is ceiling
    assert active_ceiling() is None


def _failing_ops(recompute) -> dict[str, set]:
    """For ceilings across the step's range: where each out-of-memory was raised (forward or backward) and the
    operator that crossed."""
    model = _model()
    x = torch.randn(256, 64, requires_grad=recompute is not None)
    existing = [*model.parameters(), x]   # (the garbage collector's walk is the first test's)
    with DeviceCeiling(UNLIMITED, existing) as probe:
        start = probe.live_bytes
        _step(model, x, recompute)
        peak = probe.peak_bytes
    found: dict[str, set] = {"forward": set(), "backward": set()}
    for fraction in [i / 20 for i in range(1, 20)]:
        model.zero_grad(set_to_none=True)
        with DeviceCeiling(int(start + (peak - start) * fraction), existing):
            phase, y, loss = "forward", None, None
            try:
                y = model(x) if recompute is None else checkpoint(model, x, use_reentrant=recompute)
                loss = y.square().sum()
                phase = "backward"
                loss.backward()
            except torch.OutOfMemoryError as err:
                found[phase].add(str(err).split(": ")[1].split(" allocated")[0])
            del y, loss
    return found


@pytest.mark.parametrize("recompute", [None, False, True], ids=["plain", "checkpoint", "reentrant"])
def test_an_allocation_past_the_ceiling_raises_in_forward_backward_and_a_recompute_replay(recompute):
    found = _failing_ops(recompute)
    assert found["forward"] and found["backward"], found
    if recompute is not None:   # GELU runs in backward only as the recompute replays the forward
        assert "aten.gelu.default" in found["backward"], found


def test_the_optimizer_step_runs_out_too():
    model = _model()
    _step(model, torch.randn(32, 64), None)
    optimizer = torch.optim.Adam(model.parameters())
    existing = [*model.parameters(), *(p.grad for p in model.parameters())]
    with DeviceCeiling(UNLIMITED, existing) as ceiling:
        room = ceiling.live_bytes + 1024
    with DeviceCeiling(room, existing), pytest.raises(torch.OutOfMemoryError, match="emulated device out of memory") as err:
        optimizer.step()   # Adam's states are born in the first step
    # named by where it was raised: the optimizer step, not a micro-batch (core/out_of_memory.py)
    assert oom.phase_of(err.value) == oom.OPTIMIZER
    with DeviceCeiling(room, existing), pytest.raises(torch.OutOfMemoryError) as err:
        model(torch.randn(512, 64))
    assert oom.phase_of(err.value) == oom.MICROBATCH


def test_without_the_flag_nothing_is_counted():
    assert isinstance(emulated_device(None), contextlib.nullcontext)
    assert isinstance(emulated_device(0.5), DeviceCeiling) and emulated_device(0.5).limit_bytes == 1 << 29
    with pytest.raises(ValueError, match="positive"):
        DeviceCeiling(0)
