"""DCP inside Megatron's training loop: the forward-backward function `train()` runs under `--dcp`.

megatron.training's `train()` asks `get_forward_backward_func()` once for the schedule it calls
every step with the step's data iterator and `num_microbatches = get_num_microbatches()`, the same
on every rank. Under `--dcp` (patches/training_training.py) it gets a `DcpForwardBackward` around
Megatron's own no-pipelining schedule, which per training step:

1. pulls this rank's share of the global batch from Megatron's iterator (`num_microbatches`
   pulls: exactly the samples Megatron would have trained this step), cuts it into documents,
   gathers every rank's lengths, plans the step (the same plan on every rank), exchanges the
   documents (`global_batch.py`), and builds this rank's micro-batch dicts (`microbatches.py`);
2. runs Megatron's schedule on them with THIS rank's count (ranks differ), the user's
   `forward_step` unchanged; the iterator switches each micro-batch's recompute on the model
   right when `get_batch` pulls it, i.e. just before that micro-batch's forward;
3. leaves the loss to Megatron's `--calculate-per-token-loss` path: each micro-batch backpropagates
   its unscaled token-loss sum, `finalize_model_grads` all-reduces the token count over the data-
   parallel group (with Megatron's CP kept at 1, exactly the DCP domain) and divides: gradients
   are those of one device on the whole global batch.

Evaluation (`forward_only=True`) runs Megatron's schedule unchanged.
"""
from __future__ import annotations

import time
from datetime import timedelta
from typing import Iterator

import torch

from dcp_megatron.megatron.dcp_args import DcpConfig
from dcp_megatron.megatron.global_batch import DocumentIndex, exchange_documents, gather_lengths, split_samples
from dcp_megatron.megatron.microbatches import MICROBATCH_KEY, rank_batches
from dcp_megatron.megatron.plan_dump import PlanDumper
from dcp_megatron.megatron.plan_log import plan_summary
from dcp_megatron.megatron.planning import build_cost_model, check_longest_fits, check_same_plan, plan_global_batch
from dcp_megatron.megatron.recompute import apply_recompute, restore_recompute, snapshot_recompute
from dcp_megatron.planner.model import ModelShape
from dcp_megatron.runtime.group_pool import plan_blocks


class _RecomputeSwitchingIterator:
    """Hands out micro-batch dicts; sets each one's recompute on the model as it is pulled."""

    def __init__(self, batches: list[dict], *, model_chunks, config) -> None:
        self._batches = iter(batches)
        self._model_chunks = model_chunks
        self._config = config

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        batch = next(self._batches)
        recompute = batch[MICROBATCH_KEY].recompute
        for chunk in self._model_chunks:
            apply_recompute(chunk, self._config, recompute)
        return batch


class DcpForwardBackward:
    """Megatron's forward-backward function with the step planned by DCP (see the module docstring)."""

    def __init__(self, inner, *, config: DcpConfig, model_shape: ModelShape, timeout: timedelta,
                 is_logging_rank: bool, has_gpu: bool) -> None:
        self.inner = inner
        self.config = config
        self.model_shape = model_shape
        self.timeout = timeout
        self.is_logging_rank = is_logging_rank
        self.has_gpu = has_gpu
        self._pool = None
        self._cost = None
        self._dumper = None

    # Lazily, at the first training step: every rank of the world reaches it, in the same order.
    def _setup(self) -> None:
        from dcp_megatron.megatron.domain import build_group_pool

        self._pool = build_group_pool(tp_size=self.model_shape.tp, pp_size=self.model_shape.pp, timeout=self.timeout)
        self._cost = build_cost_model(self.config, self.model_shape, domain_size=self._pool.domain_size,
                                      has_gpu=self.has_gpu)
        check_longest_fits(self.config, self._cost)
        if self.config.dump_plans and self.is_logging_rank:
            self._dumper = PlanDumper(self.config.dump_plans)

    def __call__(self, *, forward_step_func, data_iterator, model, num_microbatches: int, seq_length: int,
                 micro_batch_size: int, forward_only: bool = False, **kwargs):
        if forward_only:
            return self.inner(forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                              num_microbatches=num_microbatches, seq_length=seq_length,
                              micro_batch_size=micro_batch_size, forward_only=True, **kwargs)
        if self._pool is None:
            self._setup()
        from megatron.core.utils import get_model_config

        started = time.perf_counter()
        pool = self._pool
        model_chunks = model if isinstance(model, list) else [model]
        device = torch.device("cuda", torch.cuda.current_device()) if self.has_gpu else torch.device("cpu")
        iteration = self._iteration()

        samples = [next(data_iterator) for _ in range(num_microbatches)]
        local = split_samples(samples)
        per_rank = gather_lengths(local.lengths, group=pool.domain_group, domain_size=pool.domain_size)
        index = DocumentIndex.build(per_rank)
        plan = plan_global_batch(self.config, index.sequences(), self._cost)
        if self.config.check_plans:
            check_same_plan(plan, iteration=iteration, group=pool.domain_group, device=device)
        pool.ensure_groups(plan_blocks(plan))
        documents = exchange_documents(plan, local, index, domain_rank=pool.domain_rank, group=pool.domain_group)
        batches = rank_batches(plan, documents, pool=pool, device=device)
        planned_s = time.perf_counter() - started

        config = get_model_config(model_chunks[0])
        saved = snapshot_recompute(model_chunks, config)
        microbatches = _RecomputeSwitchingIterator(batches, model_chunks=model_chunks, config=config)
        try:
            losses_reduced = self.inner(forward_step_func=forward_step_func, data_iterator=microbatches,
                                        model=model, num_microbatches=len(batches), seq_length=seq_length,
                                        micro_batch_size=1, forward_only=False, **kwargs)
        finally:
            restore_recompute(model_chunks, config, saved)
        measured_s = time.perf_counter() - started
        if self._dumper is not None:
            self._dumper.write(iteration, plan)
        if self.is_logging_rank:
            if iteration % self.config.log_interval == 0:
                print(f" dcp iteration {iteration:8d} | {plan_summary(plan)} | predicted (ms): "
                      f"{plan.est_step_time_s * 1000:.1f} | forward-backward (ms): {measured_s * 1000:.1f} "
                      f"(planning and exchange {planned_s * 1000:.1f}) | rank {pool.domain_rank} ran "
                      f"{len(batches)} micro-batches, cp sizes "
                      f"{sorted({b[MICROBATCH_KEY].cp_size for b in batches})} |", flush=True)
        return losses_reduced

    @staticmethod
    def _iteration() -> int:
        """The 1-based iteration Megatron is running (train() sets curr_iteration before each step)."""
        from megatron.training import get_args

        return int(get_args().curr_iteration) + 1
