"""One training step on megatron-core: micro-batches through Megatron's schedule, per-token loss.

Loss is per token over the whole global batch: each micro-batch's loss function returns
(sum of its token losses, its token count); with `calculate_per_token_loss` the schedule
back-propagates the sums unscaled and `finalize_model_grads` divides every gradient by the
global token count (all-reduced over the data-parallel domain). The reported loss is the
global sum over the global count, so it does not depend on how tokens were laid out.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Iterable

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func


@dataclass(frozen=True, kw_only=True)
class StepResult:
    loss: float  # global token-mean loss (same on every rank)
    num_tokens: int  # global count of trained tokens
    grad_norm: float
    step_time_s: float
    num_microbatches: int  # on this rank


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach(), mask.sum()])
    return loss_sum, num_tokens, {"lm loss": report}


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                   packed_seq_params=batch["packed_seq_params"])
    return output, partial(_loss_func, batch["loss_mask"])


def _global_loss(losses_reduced: list[dict]) -> tuple[float, int]:
    """Sum (loss, count) over micro-batches and the DP domain; share from the last PP stage."""
    totals = torch.zeros(2, dtype=torch.float64)
    for item in losses_reduced:
        totals += item["lm loss"].to(torch.float64)
    torch.distributed.all_reduce(totals, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    last_stage_rank = parallel_state.get_pipeline_model_parallel_last_rank()
    torch.distributed.broadcast(totals, src=last_stage_rank, group=pp_group)
    return float(totals[0] / totals[1].clamp(min=1)), int(totals[1])


def train_step(microbatches: Iterable[dict], *, model, optimizer, lr_schedule) -> StepResult:
    microbatches = list(microbatches)
    start = time.perf_counter()
    model.zero_grad_buffer()
    optimizer.zero_grad()
    forward_backward = get_forward_backward_func()
    losses_reduced = forward_backward(
        forward_step_func=_forward_step,
        data_iterator=iter(microbatches),
        model=[model],
        num_microbatches=len(microbatches),
        # With variable_seq_lengths the schedule exchanges real shapes; this is only an upper bound.
        seq_length=max(mb["tokens"].shape[1] for mb in microbatches),
        micro_batch_size=1,
        forward_only=False,
    )
    update_successful, grad_norm, _ = optimizer.step()
    if not update_successful:
        raise RuntimeError("optimizer step skipped (non-finite gradients in an fp32 run)")
    lr_schedule.step(increment=1)
    loss, num_tokens = _global_loss(losses_reduced)
    return StepResult(loss=loss, num_tokens=num_tokens, grad_norm=float(grad_norm or 0.0),
                      step_time_s=time.perf_counter() - start, num_microbatches=len(microbatches))


def format_log_line(iteration: int, train_iters: int, result: StepResult, *, lr: float, consumed_tokens: int) -> str:
    """Megatron's iteration line; loss with 6 decimals in the mantissa (7 significant digits)."""
    return (f" iteration {iteration:8d}/{train_iters:8d} | consumed tokens: {consumed_tokens:12d} |"
            f" elapsed time per iteration (ms): {result.step_time_s * 1000:.1f} |"
            f" tokens/s: {result.num_tokens / result.step_time_s:.1f} | learning rate: {lr:.6E} |"
            f" lm loss: {result.loss:.6E} | grad norm: {result.grad_norm:.6f} |"
            f" micro-batches on rank: {result.num_microbatches} |")
