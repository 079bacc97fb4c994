"""One training step on megatron-core: a StepPlan's micro-batches through Megatron's schedule.

Every rank runs its own micro-batches of the plan (`plan_microbatches`): with PP = 1 the
counts may differ between ranks (Megatron's no-pipelining schedule takes any count); with
PP > 1 the planner gives every group one micro-batch per wave, so all ranks run the same count
and 1F1B interleaves identically everywhere, with variable sequence lengths between stages.

Loss is per token over the whole global batch: each micro-batch's loss function returns
(sum of its token losses, its token count); with `calculate_per_token_loss` the schedule
back-propagates the sums unscaled, and `finalize_model_grads` all-reduces gradients and the
token count over Megatron's data-parallel group (which, with Megatron's own CP size kept at 1,
is the whole DP x CP domain) and divides by the global count. Inside a CP group the K/V
gradients go back to their owners in the attention's reduce-scatter, so each rank's gradient
is a true partial sum and the result equals single-device training on the whole batch.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from dcp_megatron.megatron.recompute import apply_recompute
from dcp_megatron.runtime.stats import imbalance, predicted_busy_s


@dataclass(frozen=True, kw_only=True)
class StepResult:
    loss: float                 # global token-mean loss (same on every rank)
    num_tokens: int             # global count of trained tokens
    grad_norm: float
    step_time_s: float          # this rank's wall time of the step
    num_microbatches: int       # on this rank
    busy_s: tuple[float, ...] = ()   # per domain rank: forward+backward time before the gradient reduction
    plan: object = field(default=None, repr=False)

    @property
    def imbalance(self) -> float:
        return imbalance(list(self.busy_s))


@dataclass
class _StepTimer:
    """Time spent inside finalize_model_grads (the domain-wide gradient reduction and its wait)."""

    finalize: object
    finalize_s: float = 0.0

    def __call__(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return self.finalize(*args, **kwargs)
        finally:
            self.finalize_s += time.perf_counter() - started


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach(), mask.sum()])
    return loss_sum, num_tokens, {"lm loss": report}


def _forward_step(config, data_iterator, model):
    microbatch = next(data_iterator)
    # Switched right before this micro-batch's forward; the checkpoints replay it in backward.
    apply_recompute(model, config, microbatch.recompute)
    output = model(microbatch.tokens, microbatch.position_ids, None, labels=microbatch.labels,
                   packed_seq_params=microbatch.packed_seq_params)
    return output, partial(_loss_func, microbatch.loss_mask)


def global_loss(losses_reduced: list[dict], device) -> tuple[float, int]:
    """Sum (loss, count) over micro-batches and the DP domain; share from the last PP stage."""
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for item in losses_reduced:
        totals += item["lm loss"].to(device=device, dtype=torch.float64)
    torch.distributed.all_reduce(totals, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    torch.distributed.broadcast(totals, src=parallel_state.get_pipeline_model_parallel_last_rank(), group=pp_group)
    return float(totals[0] / totals[1].clamp(min=1)), int(totals[1])


def _gather_busy(busy_s: float, domain_group, device) -> tuple[float, ...]:
    mine = torch.tensor([busy_s], dtype=torch.float64, device=device)
    if domain_group is None:
        return (busy_s,)
    rows = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size(domain_group))]
    torch.distributed.all_gather(rows, mine, group=domain_group)
    return tuple(float(r) for r in rows)


def train_step(microbatches, *, num_microbatches: int, plan, model, optimizer, lr_schedule, config,
               domain_group, device="cpu") -> StepResult:
    start = time.perf_counter()
    model.zero_grad_buffer()
    optimizer.zero_grad()
    timer = _StepTimer(config.finalize_model_grads_func)
    config.finalize_model_grads_func = timer
    try:
        losses_reduced = get_forward_backward_func()(
            forward_step_func=partial(_forward_step, config),
            data_iterator=iter(microbatches),
            model=[model],
            num_microbatches=num_microbatches,
            # With variable_seq_lengths the schedule exchanges real shapes; this is only an upper bound.
            seq_length=1,
            micro_batch_size=1,
            forward_only=False,
        )
    finally:
        config.finalize_model_grads_func = timer.finalize
    busy = time.perf_counter() - start - timer.finalize_s
    update_successful, grad_norm, _ = optimizer.step()
    if not update_successful:
        raise RuntimeError("optimizer step skipped (non-finite gradients in an fp32 run)")
    lr_schedule.step(increment=1)
    loss, num_tokens = global_loss(losses_reduced, device)
    busy_all = _gather_busy(busy, domain_group, device)
    return StepResult(loss=loss, num_tokens=num_tokens, grad_norm=float(grad_norm or 0.0),
                      step_time_s=time.perf_counter() - start, num_microbatches=num_microbatches,
                      busy_s=busy_all, plan=plan)


def plan_summary(plan) -> str:
    """waves, CP-size histogram (sequences per CP size), micro-batches per rank, recomputed layers."""
    hist = ",".join(f"cp{c}x{n}" for c, n in plan.cp_size_histogram().items()) or "-"
    counts = [plan.num_microbatches(r) for r in range(plan.domain_size)]
    recomputed = {}
    for wave in plan.waves:
        for group in wave.groups:
            for mb in group.microbatches:
                if mb.sequences and mb.recompute.kind != "none":
                    recomputed[str(mb.recompute)] = recomputed.get(str(mb.recompute), 0) + 1
    recompute = ",".join(f"{k}x{v}" for k, v in sorted(recomputed.items())) or "none"
    return (f"plan {plan.policy}: waves {len(plan.waves)} | cp sizes {hist} | "
            f"micro-batches/rank {'/'.join(map(str, counts))} | recompute {recompute}")


def format_log_line(iteration: int, train_iters: int, result: StepResult, *, lr: float, consumed_tokens: int) -> str:
    """Megatron's iteration line; loss with 6 decimals in the mantissa (7 significant digits)."""
    plan = result.plan
    predicted = plan.est_step_time_s if plan is not None else 0.0
    predicted_imbalance = imbalance(predicted_busy_s(plan)) if plan is not None else 0.0
    line = (f" iteration {iteration:8d}/{train_iters:8d} | consumed tokens: {consumed_tokens:12d} |"
            f" elapsed time per iteration (ms): {result.step_time_s * 1000:.1f} |"
            f" predicted (ms): {predicted * 1000:.1f} |"
            f" tokens/s: {result.num_tokens / result.step_time_s:.1f} | learning rate: {lr:.6E} |"
            f" lm loss: {result.loss:.6E} | grad norm: {result.grad_norm:.6f} |"
            f" imbalance: {result.imbalance:.3f} (plan {predicted_imbalance:.3f}) |")
    if plan is not None:
        line += f" {plan_summary(plan)} |"
    return line
