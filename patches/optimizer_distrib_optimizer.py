"""CPU shims for `megatron.core.optimizer.distrib_optimizer` (the distributed optimizer; no GPU only).

- the module's `torch` is a CPU view: shard buffers and reductions use torch.cuda.current_device();
- `DistributedOptimizer._build_model_and_main_param_groups` sorts parameters by the no-argument
  `param.type()` string and refuses anything but 'torch.cuda.*Tensor'. For the duration of that
  one call, `Tensor.type()` (without arguments) names a CPU tensor's CUDA counterpart; nothing
  else sees the change;
- resuming (`--load`) a distributed-optimizer checkpoint without Apex/TE (always so on CPU) fails:
  `sharded_state_dict(is_loading=True)` calls `state_dict()`, which asserts that every parameter has
  a torch-Adam `step`, before it creates the (dummy) states it is about to load into. An upstream
  ordering bug; the fix creates the dummy states first when none exist yet. Then
  `_set_main_param_and_optimizer_states` copies the loaded values into the fp32 main parameters
  (views of leaf tensors that require grad) outside `torch.no_grad()`, which autograd refuses:
  the copy runs under no_grad. Last, `load_state_dict` gives every parameter's torch-Adam state the
  SAME `step` tensor; torch's Adam increments each parameter's step in place, so after one step the
  shared counter has advanced once per parameter and bias correction is wrong from then on (a resumed
  run's loss left the uninterrupted trace at the second step after resuming): each parameter gets
  its own copy.
"""
from __future__ import annotations

import contextlib
import functools

import torch

from patches.cpu_torch import cpu_torch_patch
from patches import MEGATRON_CORE_VERSIONS
from patches.registry import Patch

_MODULE = "megatron.core.optimizer.distrib_optimizer"


@contextlib.contextmanager
def cuda_type_names():
    """No-argument Tensor.type() reports e.g. 'torch.cuda.FloatTensor' for a CPU float tensor."""
    original = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == "cpu":
            return original(self).replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


def _with_cuda_type_names(original):
    @functools.wraps(original)
    def build(cls, *args, **kwargs):
        with cuda_type_names():
            return original(cls, *args, **kwargs)

    return classmethod(build)


def _states_before_loading(original):
    @functools.wraps(original)
    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, *args, **kwargs):
        if is_loading and not self.optimizer.state:
            self._init_optimizer_states_with_dummy_values()
        return original(self, model_sharded_state_dict, is_loading, *args, **kwargs)

    return sharded_state_dict


def _without_grad(original):
    @functools.wraps(original)
    def set_states(self, *args, **kwargs):
        with torch.no_grad():
            return original(self, *args, **kwargs)

    return set_states


def _own_step_counters(original):
    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        result = original(self, state_dict)
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].detach().clone()
        return result

    return load_state_dict


def cpu_patches() -> tuple[Patch, ...]:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = vars(DistributedOptimizer)["_build_model_and_main_param_groups"].__func__
    return (
        cpu_torch_patch(_MODULE, "shard buffers and reductions are created on torch.cuda.current_device().",
                        MEGATRON_CORE_VERSIONS),
        Patch(target=f"{_MODULE}:DistributedOptimizer._build_model_and_main_param_groups",
              replacement=_with_cuda_type_names(original),
              reason="refuses parameters whose no-argument .type() is not 'torch.cuda.*Tensor'.",
              versions=MEGATRON_CORE_VERSIONS),
        Patch(target=f"{_MODULE}:DistributedOptimizer.sharded_state_dict",
              replacement=_states_before_loading(vars(DistributedOptimizer)["sharded_state_dict"]),
              reason="upstream bug without Apex/TE: loading asserts on optimizer steps before creating the states.",
              versions=MEGATRON_CORE_VERSIONS),
        Patch(target=f"{_MODULE}:DistributedOptimizer._set_main_param_and_optimizer_states",
              replacement=_without_grad(vars(DistributedOptimizer)["_set_main_param_and_optimizer_states"]),
              reason="upstream bug without Apex/TE: loaded states are copied into grad-requiring leaf views "
                     "outside no_grad.",
              versions=MEGATRON_CORE_VERSIONS),
        Patch(target=f"{_MODULE}:DistributedOptimizer.load_state_dict",
              replacement=_own_step_counters(vars(DistributedOptimizer)["load_state_dict"]),
              reason="upstream bug without Apex/TE: one shared Adam step tensor for all parameters after a load.",
              versions=MEGATRON_CORE_VERSIONS),
    )
