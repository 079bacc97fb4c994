"""Run one step of a plan on this rank: its groups, its micro-batches, exact per-token gradients.

    executor = StepExecutor(pool)
    for ctx in executor.microbatches(plan):
        apply_recompute(model, ctx.recompute)
        tokens = ctx.shard.take(tokens_of(ctx.microbatch))           # this rank's rows
        labels = ctx.shard.take(labels_of(ctx.microbatch), fill=IGNORE_INDEX)
        attention = partial(cp_attention, shard=ctx.shard, group=ctx.group)
        loss_sum, count = token_loss_sum(model(tokens, ctx.shard.position_ids, attention), labels)
        executor.backward(loss_sum, count)
    result = executor.finish_step(model.parameters())   # gradients reduced and scaled; result.loss

The rank walks the waves in order and is in exactly one group per wave, so all members of every
group issue their collectives in the same order (no barrier between waves is needed). Before a
wave's first micro-batch the members exchange one 1-element all-reduce: that is where a rank waits
for its slower new partners, so the wait is measured there rather than hidden inside the first
attention. Gradients are not synchronised per micro-batch: they accumulate in .grad and are
reduced once over the domain after the rank's last micro-batch (see loss.py for why that is
exact). A DDP-wrapped model can use `ctx.is_last_microbatch` to leave no_sync().

Every collective this module issues turns a failure (a dead peer, or one past the group timeout)
into CollectiveFailed naming the rank, the wave and the group.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from dcp_megatron.planner.plan import Group, MicroBatch, Recompute, StepPlan
from dcp_megatron.runtime.group_pool import GroupPool, plan_blocks
from dcp_megatron.runtime.loss import CollectiveFailed, StepLoss, reduce_step
from dcp_megatron.runtime.sharding import LocalShard, shard_microbatch
from dcp_megatron.runtime.stats import RankTimes, StepStats, gather_step_stats


@dataclass(frozen=True)
class MicroBatchContext:
    """Everything this rank needs to run one micro-batch of the plan."""

    wave_index: int
    microbatch_index: int            # position inside its group's micro-batches of this wave
    group: "dist.ProcessGroup | None"  # None when the group is this rank alone
    group_first_rank: int            # domain rank of the group's first member
    group_size: int                  # CP size of this micro-batch
    group_rank: int                  # this rank's position in the group (its zig-zag chunk pair)
    microbatch: MicroBatch
    shard: LocalShard
    recompute: Recompute
    is_last_microbatch: bool         # last micro-batch of this rank in the step

    @property
    def sample_ids(self) -> list[int]:
        return [sample_id for sample_id, _ in self.microbatch.sequences]


@dataclass(frozen=True)
class StepResult:
    loss: float          # global sum of token losses / global token count
    num_tokens: int      # global number of label tokens
    stats: StepStats | None


class StepExecutor:
    """Executes StepPlans on this rank of the pool's domain."""

    def __init__(self, pool: GroupPool, *, device: torch.device | str = "cpu", measure_waits: bool = True,
                 collect_stats: bool = True) -> None:
        self.pool = pool
        self.device = torch.device(device)
        self.measure_waits = measure_waits
        self.collect_stats = collect_stats
        self._plan: StepPlan | None = None
        self._finished_walk = False
        self._loss = StepLoss()
        self._reset_times(0)

    def _reset_times(self, num_waves: int) -> None:
        self._step_start = time.perf_counter()
        self._compute_s = 0.0
        self._wave_wait_s = [0.0] * num_waves
        self._num_microbatches = 0

    # ---- the walk ------------------------------------------------------------------------------
    def schedule(self, plan: StepPlan) -> list[tuple[int, int, Group, MicroBatch]]:
        """(wave index, index in group, group, micro-batch) this rank runs, in order. No communication."""
        return [(w, i, group, mb) for w, group in plan.rank_schedule(self.pool.domain_rank)
                for i, mb in enumerate(group.microbatches)]

    def microbatches(self, plan: StepPlan) -> Iterator[MicroBatchContext]:
        """Yield this rank's micro-batches of the step in order; the caller runs forward and backward."""
        if plan.domain_size != self.pool.domain_size:
            raise ValueError(f"plan is for a domain of {plan.domain_size} ranks, the pool's domain has "
                             f"{self.pool.domain_size}")
        if self._plan is not None:
            raise RuntimeError("finish_step() was not called after the previous step")
        # Collective over the world when the plan needs a block for the first time (same on every rank).
        self.pool.ensure_groups(plan_blocks(plan))
        self._plan, self._finished_walk, self._loss = plan, False, StepLoss()
        self._reset_times(len(plan.waves))
        rank = self.pool.domain_rank
        schedule = self.schedule(plan)
        last_position = len(schedule) - 1
        position = 0
        for wave_index, group in plan.rank_schedule(rank):
            process_group = self.pool.group(group.first_rank, group.size)
            if group.microbatches and process_group is not None and self.measure_waits:
                self._wave_wait_s[wave_index] = self._wait_for_group(process_group, wave_index, group)
            for mb_index, microbatch in enumerate(group.microbatches):
                group_rank = rank - group.first_rank
                ctx = MicroBatchContext(
                    wave_index=wave_index, microbatch_index=mb_index, group=process_group,
                    group_first_rank=group.first_rank, group_size=group.size, group_rank=group_rank,
                    microbatch=microbatch, shard=shard_microbatch(microbatch.lengths, group.size, group_rank),
                    recompute=microbatch.recompute, is_last_microbatch=position == last_position)
                started = time.perf_counter()
                yield ctx
                self._compute_s += time.perf_counter() - started
                self._num_microbatches += 1
                position += 1
        self._finished_walk = True

    def _wait_for_group(self, process_group, wave_index: int, group) -> float:
        token = torch.zeros(1, device=self.device)
        started = time.perf_counter()
        try:
            dist.all_reduce(token, group=process_group)
        except RuntimeError as err:
            raise CollectiveFailed(
                f"domain rank {self.pool.domain_rank}: wave {wave_index} group of domain ranks "
                f"[{group.first_rank}, {group.first_rank + group.size}) did not assemble — a peer rank died or did "
                f"not arrive within the group timeout ({self.pool.timeout.total_seconds():g} s): {err}") from err
        return time.perf_counter() - started

    # ---- loss and the end of the step ------------------------------------------------------------
    def backward(self, loss_sum: torch.Tensor, num_tokens: int) -> None:
        """Backpropagate a micro-batch's unscaled local loss sum and count its label tokens."""
        if self._plan is None:
            raise RuntimeError("backward() outside a step: iterate microbatches(plan) first")
        loss_sum.backward()
        self._loss.add(loss_sum, num_tokens)

    def record_loss(self, loss_sum: torch.Tensor | float, num_tokens: int) -> None:
        """Count a micro-batch whose backward the caller ran itself (e.g. inside a pipeline schedule)."""
        if self._plan is None:
            raise RuntimeError("record_loss() outside a step: iterate microbatches(plan) first")
        self._loss.add(loss_sum, num_tokens)

    def finish_step(self, parameters: Iterable[torch.nn.Parameter]) -> StepResult:
        """Reduce gradients over the domain (scaled by 1 / global token count) and gather the stats."""
        if self._plan is None or not self._finished_walk:
            raise RuntimeError("finish_step() before this rank walked all micro-batches of the step")
        plan, self._plan = self._plan, None
        started = time.perf_counter()
        loss, num_tokens = reduce_step(parameters, self._loss, self.pool.domain_group)
        finished = time.perf_counter()
        stats = None
        if self.collect_stats:
            local = RankTimes(domain_rank=self.pool.domain_rank, num_microbatches=self._num_microbatches,
                              compute_s=self._compute_s, wave_wait_s=tuple(self._wave_wait_s),
                              reduce_s=finished - started, step_s=finished - self._step_start)
            stats = gather_step_stats(local, plan, self.pool.domain_group, device=self.device)
        return StepResult(loss=loss, num_tokens=num_tokens, stats=stats)
