"""Per-token loss over a whole DCP step, and the deferred gradient reduction that makes it exact.

The target is single-device training on the whole global batch with a per-token mean loss:

    loss = (1 / N) * sum over all label tokens t of the batch of CE_t,   N = number of label tokens.

Every micro-batch on every rank backpropagates the plain SUM of its local token losses (no
scaling), so after the rank's last micro-batch each parameter's .grad holds the partial sum
over the tokens this rank computed. That is a true partial sum even for CP groups: inside
cp_attention the gradients of the gathered K/V are reduce-scattered back to the rank that
produced them, so a rank's projection weights receive the contributions of every query of the
group that attended to its keys, and nothing is counted twice. Summing .grad over the whole
domain therefore yields d(sum of all token losses)/dθ, whatever the layout, and one scaling by
1 / N (N all-reduced alongside) gives the single-device gradient. The reported loss is the
global sum over the global count. Scaling once at the end, rather than by a per-micro-batch
count, is what makes unequal micro-batches and unequal ranks weigh their tokens correctly.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

IGNORE_INDEX = -100  # label of tokens without a target: each document's last token and padding rows

# Gradients are all-reduced in flat buckets of at most this many elements (bounds the extra memory).
GRAD_BUCKET_NUMEL = 1 << 24


class CollectiveFailed(RuntimeError):
    """A collective of the step did not complete: a peer rank died, or stalled past the group timeout."""


def next_token_labels(tokens: torch.Tensor, doc_lengths: Sequence[int]) -> torch.Tensor:
    """Labels for packed documents: the next token of the same document, IGNORE_INDEX at each document's end."""
    if tokens.dim() != 1 or tokens.numel() != sum(doc_lengths):
        raise ValueError(f"tokens must be 1-D with sum(doc_lengths)={sum(doc_lengths)} entries, "
                         f"got shape {tuple(tokens.shape)}")
    labels = torch.full_like(tokens, IGNORE_INDEX)
    labels[:-1] = tokens[1:]
    ends = torch.cumsum(torch.tensor(list(doc_lengths), dtype=torch.int64), 0) - 1
    labels[ends] = IGNORE_INDEX
    return labels


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(sum of cross-entropy over rows whose label is not IGNORE_INDEX, number of such rows).

    The sum stays connected to the graph even when it has no valid row (a CP rank holding only
    padding), so that rank still runs backward and joins its group's collectives.
    """
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(f"expected logits [T, V] and labels [T], got {tuple(logits.shape)} and {tuple(labels.shape)}")
    loss_sum = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss_sum, int((labels != IGNORE_INDEX).sum())


class StepLoss:
    """This rank's running (sum of token losses, token count) over the micro-batches of one step."""

    def __init__(self) -> None:
        self.loss_sum = 0.0
        self.num_tokens = 0

    def add(self, loss_sum: torch.Tensor | float, num_tokens: int) -> None:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        self.loss_sum += float(loss_sum.detach()) if isinstance(loss_sum, torch.Tensor) else float(loss_sum)
        self.num_tokens += int(num_tokens)


def reduce_step(parameters: Iterable[torch.nn.Parameter], step_loss: StepLoss,
                group: "dist.ProcessGroup | None") -> tuple[float, int]:
    """Sum gradients and (loss, count) over the domain, scale gradients by 1 / global count.

    Returns (global mean token loss, global token count). Parameters without a gradient (a rank
    that ran no micro-batch) take part with zeros so that every rank issues the same collectives.
    """
    params = [p for p in parameters if p.requires_grad]
    device = params[0].device if params else torch.device("cpu")  # NCCL needs the tensor on the GPU
    totals = torch.tensor([step_loss.loss_sum, float(step_loss.num_tokens)], dtype=torch.float64, device=device)
    _all_reduce(totals, group, "all-reduce of the step's loss and token count")
    loss_sum, num_tokens = float(totals[0]), int(round(float(totals[1])))
    if num_tokens <= 0:
        raise ValueError("the step has no label tokens across the domain; cannot form a per-token loss")
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for bucket in _buckets(params):
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        _all_reduce(flat, group, "deferred gradient all-reduce")
        flat.mul_(1.0 / num_tokens)
        offset = 0
        for p in bucket:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()
    return loss_sum / num_tokens, num_tokens


def _buckets(params: list[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
    """Consecutive parameters of one dtype and device, at most GRAD_BUCKET_NUMEL elements per bucket."""
    buckets: list[list[torch.nn.Parameter]] = []
    size = 0
    for p in params:
        last = buckets[-1] if buckets else None
        if (last is None or size + p.numel() > GRAD_BUCKET_NUMEL
                or (last[0].grad.dtype, last[0].grad.device) != (p.grad.dtype, p.grad.device)):
            buckets.append([p])
            size = p.numel()
        else:
            last.append(p)
            size += p.numel()
    return buckets


def _all_reduce(tensor: torch.Tensor, group: "dist.ProcessGroup | None", what: str) -> None:
    if group is None:
        return
    try:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    except RuntimeError as err:
        raise CollectiveFailed(f"rank {dist.get_rank()}: {what} over the DCP domain failed — a peer rank "
                               f"died or did not arrive within the group timeout: {err}") from err
