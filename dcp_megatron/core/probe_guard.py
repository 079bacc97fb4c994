"""Run extra forward and backward passes that leave training exactly as without them (the memory probe).

What a megatron-core forward and backward change besides the activations, and how `untouched_training_state`
puts each back:

- gradients: the DDP grad buffers (and a parameter's `.grad` where one is kept) accumulate. Inside, no bucket
  starts its reduction (every chunk under `no_sync`, the schedule's own `no_sync_func` and `finalize_model_grads_func`
  off), so nothing is in flight when the buffers are zeroed at the end; a `.grad` that was None is None again.
  The probe runs where a training step starts (its buffers just zeroed by Megatron's `train_step`);
- random numbers: torch's CPU and CUDA generators and megatron-core's model-parallel RNG tracker (dropout) are
  read before and set back after;
- module buffers: an MoE router's `local_tokens_per_expert` (the expert-bias update's counts) and any other
  buffer a forward updates are copied before and copied back;
- loggers: the MoE metrics tracker (auxiliary losses) and the MTP loss tracker take the probe's records in a
  fresh tracker that is dropped after; the rerun state machine's per-step validation counts are set back.

Not restored: Transformer Engine's FP8 scaling history (a probe's forward adds its amax to it on GPU).
"""
from __future__ import annotations

import contextlib

import torch


def _rng_states() -> tuple:
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracked = {name: state.clone() for name, state in tracker.get_states().items()}
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return torch.get_rng_state(), cuda, tracker, tracked


def _set_rng_states(states: tuple) -> None:
    cpu, cuda, tracker, tracked = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    tracker.set_states(tracked)


@contextlib.contextmanager
def _fresh_loggers():
    """The MoE metrics tracker and the MTP loss tracker swapped for fresh ones while inside."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.core.transformer.moe import moe_logging
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    moe_tracker, mtp_tracker = moe_logging.get_moe_metrics_tracker(), MTPLossLoggingHelper.tracker
    rerun = get_rerun_state_machine()
    counts = dict(rerun.validation_counts)
    moe_logging.set_moe_metrics_tracker(moe_logging.MoEMetricsTracker())
    MTPLossLoggingHelper.tracker = {}
    try:
        yield
    finally:
        moe_logging.set_moe_metrics_tracker(moe_tracker)
        MTPLossLoggingHelper.tracker = mtp_tracker
        rerun.validation_counts.clear()
        rerun.validation_counts.update(counts)


@contextlib.contextmanager
def untouched_training_state(model_chunks, config):
    """Forward and backward passes inside leave gradients, RNG, buffers and loggers as they were (module
    docstring); `config`: the chunks' TransformerConfig (the schedule's hooks)."""
    rng = _rng_states()
    # (nn.Module's own: Megatron's DDP names its grad buffers `buffers`)
    buffers = [(b, b.detach().clone()) for chunk in model_chunks for b in torch.nn.Module.buffers(chunk)]
    params = [p for chunk in model_chunks for p in chunk.parameters()]
    had_grad = [p.grad is not None for p in params]
    hooks = config.no_sync_func, config.finalize_model_grads_func
    config.no_sync_func = config.finalize_model_grads_func = None
    try:
        with contextlib.ExitStack() as stack:
            for chunk in model_chunks:
                if hasattr(chunk, "no_sync"):
                    stack.enter_context(chunk.no_sync())
            stack.enter_context(_fresh_loggers())
            yield
    finally:
        config.no_sync_func, config.finalize_model_grads_func = hooks
        for chunk in model_chunks:
            if hasattr(chunk, "zero_grad_buffer"):
                chunk.zero_grad_buffer()
        for param, had in zip(params, had_grad):
            if not had:
                param.grad = None
            elif param.grad is not None:
                param.grad.zero_()
        with torch.no_grad():
            for buffer, copy in buffers:
                buffer.copy_(copy)
        _set_rng_states(rng)
