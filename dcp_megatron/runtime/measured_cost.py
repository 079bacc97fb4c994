"""Online refinement's one collective: every rank's measured micro-batch times, summed, into the cost model.

Each rank times the micro-batches it ran (`planner/costmodel/refine.py` buckets them by CP size and relief,
the buckets the plan uses); one all-reduce of the bucket sums gives every rank the same totals, so the corrected cost
model, and therefore the next plans, stay identical everywhere. Used by the Megatron and the
DeepSpeed adapters alike.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from dcp_megatron.planner.costmodel.refine import MeasuredMicroBatch, TimeCorrection, plan_buckets


def refined_cost(correction: TimeCorrection, base_cost, plan, *, domain_rank: int, durations: list[float],
                 device, group=None):
    """`base_cost` with the correction updated by this step's measured times (collective over `group`).

    `durations[i]` is the i-th micro-batch this rank ran, in plan order; untimed trailing ones (the
    step's last, which carries the gradient reduction) are simply absent."""
    ran = [(group_, microbatch) for _, group_ in plan.rank_schedule(domain_rank) for microbatch in group_.microbatches]
    measured = [MeasuredMicroBatch(cp_size=group_.size, relief=str(mb.recompute), measured_s=seconds,
                                   predicted_s=base_cost.microbatch_time(mb.lengths, group_.size,
                                                                         first_rank=group_.first_rank,
                                                                         recompute=mb.recompute))
                for (group_, mb), seconds in zip(ran, durations) if mb.sequences]
    buckets = plan_buckets(plan)   # the same on every rank: they all hold this plan
    sums = torch.tensor(correction.bucket_sums(measured, buckets), dtype=torch.float64, device=device)
    dist.all_reduce(sums, group=group)
    return base_cost.with_time_scale(correction.update(sums.tolist(), buckets))
