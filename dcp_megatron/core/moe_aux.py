"""Under `--dcp`, a Mixture-of-Experts router's balancing and z losses are per document, whatever the plan.

megatron-core 0.19.2 computes the load-balancing loss from the token counts of one micro-batch (`aux_loss`) or of
one sample (`seq_aux_loss`). Under DCP a micro-batch is the plan's packing of whole documents over a CP group of
its own, and changes with every step's lengths: a statistic over it would make the objective depend on the plan.
So both become statistics of each document d, counted over all the ranks that hold it:

    aux_d = E * coeff / (topk * T_d**2) * sum_e count_d[e] * probs_d[e]

(T_d real tokens, count_d[e] tokens routed to expert e, probs_d[e] their router probabilities summed), and enter
the gradient weighted by T_d, as Megatron's per-token loss weights a micro-batch by its tokens: the step
optimises sum_d T_d * aux_d / (the step's loss tokens). Without --dataloader-inter-document-masking a document is
one of Megatron's samples, and this is exactly Megatron's loss at --micro-batch-size 1 (both kinds); with it,
Megatron's unit is the sample (documents that only share a sample are balanced together), DCP's the document.

The z-loss is per token already; only its rows change (padding and filler rows left out) and its logged value.

Logged values: the token-weighted mean over the step's documents, sum_d T_d * aux_d / sum_d T_d (z-loss: the mean
over real tokens), which is what Megatron logs at --micro-batch-size 1 on samples of one length. Each rank
records its share; `logged_share` scales it for Megatron's MoE logger (module docstring of the router patch).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RouterDocuments:
    """What a router needs to know of the DCP micro-batch it routes (this rank's rows)."""

    document_ids: torch.Tensor          # int64 [T_local]: the row's document in the micro-batch, -1 at padding/filler
    document_lengths: tuple[int, ...]   # real tokens of each document, whole (all ranks of the group together)
    groups: tuple = ()                  # the groups holding the documents' other rows: CP group, TP group (SP)
    step_num_tokens: int = 0            # real tokens of the step's global batch, all ranks of the domain

    def __post_init__(self) -> None:
        assert self.document_ids.dim() == 1, self.document_ids.shape
        assert all(length > 0 for length in self.document_lengths), self.document_lengths
        assert self.step_num_tokens >= sum(self.document_lengths), (self.step_num_tokens, self.document_lengths)

    @property
    def valid_rows(self) -> torch.Tensor:
        return self.document_ids >= 0

    @property
    def padding_mask(self) -> torch.Tensor:
        """bool [1, T_local], True at padding and filler rows: upstream's MoE `padding_mask` seam."""
        return (self.document_ids < 0).unsqueeze(0)

    def sequence_parallel_share(self, tp_rank: int, tp_size: int, tp_group) -> "RouterDocuments":
        """The rows a sequence-parallel TP rank routes (its contiguous 1/tp of the micro-batch's local rows; DCP
        pads every document so they split evenly), whose documents' other rows are also on the TP peers."""
        rows = self.document_ids.numel()
        assert rows % tp_size == 0, (rows, tp_size)
        share = rows // tp_size
        return replace(self, document_ids=self.document_ids[tp_rank * share:(tp_rank + 1) * share],
                       groups=(*self.groups, tp_group))


def load_balancing_loss(scores: torch.Tensor, routing_map: torch.Tensor, documents: RouterDocuments, *,
                        topk: int, num_experts: int, coeff: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, share). `loss`: this rank's part of sum_d T_d * aux_d (differentiable through `scores`; the ranks'
    parts add up to the micro-batch's). `share`: the same without the coefficient, detached, for logging.

    scores, routing_map: [T_local, E], the router's scores and top-k map for the aux loss."""
    valid = documents.valid_rows.to(scores.device)
    ids = documents.document_ids.to(scores.device)[valid]
    num_documents = len(documents.document_lengths)
    counts = torch.zeros(num_documents, num_experts, dtype=torch.float32, device=scores.device)
    counts.index_add_(0, ids, routing_map[valid].to(torch.float32))
    for group in documents.groups:
        # every member of each group routes the same micro-batch, so all join this once per layer and pass
        dist.all_reduce(counts, group=group)
    probs = torch.zeros(num_documents, num_experts, dtype=scores.dtype, device=scores.device)
    probs = probs.index_add(0, ids, scores[valid])
    lengths = torch.tensor(documents.document_lengths, dtype=scores.dtype, device=scores.device)
    weighted = ((counts.to(scores.dtype) * probs).sum(dim=1) / lengths).sum() * (num_experts / topk)
    return weighted * coeff, weighted.detach()


def z_loss(logits: torch.Tensor, documents: RouterDocuments, *, coeff: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, share): coeff x the sum of logsumexp(logits)^2 over this rank's real rows (per-token weighting), and
    the sum itself, detached. logits: [T_local, E]."""
    valid = documents.valid_rows.to(logits.device)
    total = torch.logsumexp(logits[valid].float(), dim=-1).square().sum()
    return total * coeff, total.detach()


def logged_share(share: torch.Tensor, documents: RouterDocuments, num_microbatches: int) -> torch.Tensor:
    """A rank's share, as Megatron's MoE logger must receive it to print the token-weighted mean: the logger sums
    a step's records, sums over the record's group (here the whole domain), averages over data parallel (the
    domain again: a no-op on equal values) and multiplies by 1 / num_microbatches."""
    if documents.step_num_tokens == 0:   # a filler-only step cannot happen; keep the logger finite regardless
        return share * 0
    return share * (num_microbatches / documents.step_num_tokens)


def microbatch_documents(document_ids: torch.Tensor, valid_rows: torch.Tensor, num_real_documents: int) -> torch.Tensor:
    """Row -> document index, -1 at padding rows and at filler documents (index >= `num_real_documents`)."""
    return torch.where(valid_rows & (document_ids < num_real_documents), document_ids, torch.full_like(document_ids, -1))
