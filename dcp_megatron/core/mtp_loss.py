"""Under `--dcp`, the multi-token-prediction (MTP) loss is weighted per document, whatever the plan.

megatron-core 0.19.2 shifts a micro-batch's labels and loss mask left by one per MTP depth, within each packed
document, and (with the per-token loss DCP runs) scales the micro-batch's MTP token losses by
(loss tokens before the shift) / (loss tokens after it), counted over the whole micro-batch. Under DCP a
micro-batch is the plan's packing of documents, so that ratio would change with the plan. Here it is each
document's own, counted over every rank that holds the document's rows:

    loss_mtp = scale * sum_d (M_d / R_d) * sum_{t in d} rolled_mask_t * loss_t      (divided by the step's tokens)

(M_d the document's loss tokens, R_d those left after the shift). Without --dataloader-inter-document-masking a
document is one of Megatron's samples, and this is Megatron's loss at --micro-batch-size 1; with it Megatron's
unit is the sample (documents that share a sample share one ratio), DCP's the document.

Logged value: sum_d T_d * (S_d / R_d) / sum_d T_d (T_d the document's real tokens, S_d its shifted, masked MTP
loss sum): what Megatron logs at --micro-batch-size 1 on samples of one length, its mean of per-sample means.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dcp_megatron.core.moe_aux import RouterDocuments


@dataclass(frozen=True)
class MtpRowWeights:
    """Per local row of a DCP micro-batch (0 at padding and filler rows)."""

    gradient: torch.Tensor   # M_d / R_d of the row's document: the factor on its token loss
    logged: torch.Tensor     # T_d / R_d of the row's document: the factor of its logged share


def mtp_row_weights(loss_mask: torch.Tensor, rolled_mask: torch.Tensor, documents: RouterDocuments,
                    group=None) -> MtpRowWeights:
    """Each row's document weights; `loss_mask` before the shift, `rolled_mask` after it (both [.., T_local]).
    `group`: the micro-batch's CP group (None alone): the document's other rows are there."""
    ids = documents.document_ids.to(loss_mask.device)
    valid = ids >= 0
    num_documents = len(documents.document_lengths)
    counts = torch.zeros(2, num_documents, dtype=torch.float64, device=loss_mask.device)
    counts[0].index_add_(0, ids[valid], loss_mask.reshape(-1)[valid].to(torch.float64))
    counts[1].index_add_(0, ids[valid], rolled_mask.reshape(-1)[valid].to(torch.float64))
    if group is not None:
        # every member of the group runs this micro-batch, so all join this once per MTP depth
        dist.all_reduce(counts, group=group)
    rolled = counts[1].clamp(min=1)
    lengths = torch.tensor(documents.document_lengths, dtype=torch.float64, device=loss_mask.device)
    rows = ids.clamp(min=0)

    def per_row(per_document: torch.Tensor) -> torch.Tensor:
        if num_documents == 0:
            return torch.zeros(ids.shape, dtype=loss_mask.dtype, device=loss_mask.device)
        return torch.where(valid, per_document[rows], 0).to(loss_mask.dtype).view_as(loss_mask)

    return MtpRowWeights(gradient=per_row(counts[0] / rolled), logged=per_row(lengths / rolled))


def logged_mtp_share(token_losses: torch.Tensor, weights: MtpRowWeights, documents: RouterDocuments, *,
                     average_size: int, num_microbatches: int) -> torch.Tensor:
    """This rank's record of one micro-batch for megatron-core's MTP logger, which sums a step's records,
    averages them over the data-parallel x CP group (`average_size` ranks: the domain) and multiplies by
    1 / num_microbatches: the printed value is then the token-weighted mean of the module docstring.
    `token_losses`: the shifted, masked token losses."""
    share = (token_losses.detach() * weights.logged).sum()
    if documents.step_num_tokens == 0:   # a filler-only micro-batch records nothing
        return share * 0
    return share * (average_size * num_microbatches / documents.step_num_tokens)
