"""Evaluation in the DeepSpeed script: Megatron's validation split, planned like a training step, forward only.

With `--eval-interval N` or `--eval-iters K` given (Megatron's flags; Megatron's defaults, 100 batches every
1000 iterations, apply once either is given) the script evaluates after every N-th step and at the end of
training, as megatron.training does: K global batches of `--eval-global-batch-size` samples (default
`--global-batch-size`) from the validation split (`--split`, or `--valid-data-path`), read in order across
evaluations from a dataset sized as Megatron sizes it ((train_iters // N + 1) x K batches). Each batch is
planned as a training step is (the run's policy and cost model: `--dcp`'s plans, lockstep under ZeRO-3, or the
static layout), its documents exchanged and its micro-batches run forward under `torch.no_grad()`; the
reported loss is Megatron's with `--calculate-per-token-loss`: the validation tokens' loss sum over their
count, so it is the same for any layout and world size.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from dcp_megatron.core.global_batch import DocumentIndex, exchange_documents, gather_lengths
from dcp_megatron.core.microbatches import rank_batches
from dcp_megatron.core.planning import plan_global_batch
from dcp_megatron.core.recompute import apply_recompute
from dcp_megatron.planner.plan import NO_RECOMPUTE
from dcp_megatron.runtime.group_pool import plan_blocks

def validation_samples(args) -> int:
    """Samples of the validation dataset Megatron builds for this run (training.py's eval_samples)."""
    return (args.train_iters // args.eval_interval + 1) * args.eval_iters * args.eval_global_batch_size


class Evaluation:
    """Validation batches over the run's layout (module docstring)."""

    def __init__(self, *, shares, config, cost, pool, forward_loss, device, eval_iters: int) -> None:
        self.shares = shares   # samples.SampleShares over the validation dataset
        self.config, self.cost, self.pool = config, cost, pool
        self.forward_loss, self.device = forward_loss, device
        self.eval_iters = eval_iters

    def evaluate(self, engine) -> float:
        """The validation loss of the next `eval_iters` batches (a collective: every rank calls it)."""
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        engine.eval()
        try:
            for _ in range(self.eval_iters):
                totals += self._batch(engine)
        finally:
            engine.train()
        dist.all_reduce(totals)
        loss_sum, tokens = totals.tolist()
        if tokens < 1:
            raise RuntimeError("the validation batches hold no token to score")
        return loss_sum / tokens

    def _batch(self, engine) -> torch.Tensor:
        local = self.shares.next_share()
        if local is None:
            raise RuntimeError(f"the validation data ran out after {self.shares.consumed_samples} samples")
        pool = self.pool
        index = DocumentIndex.build(gather_lengths(local.lengths, group=pool.domain_group, domain_size=pool.domain_size))
        plan = plan_global_batch(self.config, index.sequences(), self.cost)
        pool.ensure_groups(plan_blocks(plan))
        documents = exchange_documents(plan, local, index, domain_rank=pool.domain_rank, group=pool.domain_group)
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        with torch.no_grad():
            for batch in rank_batches(plan, documents, pool=pool, device=self.device):
                apply_recompute(engine.module, NO_RECOMPUTE)   # forward only: nothing to replay
                loss_sum, valid = self.forward_loss(engine, batch)
                sums += torch.stack([loss_sum.double(), torch.tensor(float(valid), dtype=torch.float64,
                                                                     device=self.device)])
        return sums
