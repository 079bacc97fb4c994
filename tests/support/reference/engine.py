"""The planned-step loop's test engine: the reference GPT (TinyGPT, tiny_gpt.py) on the loop's micro-batch dicts.

Gradient parity (tests/integration/test_runtime_parity.py, tools/check_parity.py) and runtime speed (tools/bench_runtime.py)
run the loop users run (dcp_megatron/core/step_loop.py: reading, planning ahead, plan agreement, the document exchange, the
micro-batch dicts of `rank_batches`) with this engine where Megatron's schedule or DeepSpeed's engine would be:

    loop = PlannedStepLoop(config=..., pool=pool, cost=cost, device="cpu", is_logging_rank=False,
                           plan_function=...)           # the planner, or any StepPlan maker
    engine = ReferenceEngine(model, pool=pool, batches=iter(global_batches), tokens_of=tokens_of)
    result = loop.step(engine, iteration=1, num_samples=1, next_num_samples=1)   # a StepResult

Rank r reads the documents r, r + D, r + 2D, ... of each global batch (tokens from `tokens_of`, labels the next
token, the last token of a document out of the loss); the loop sends them where the plan runs them. Per
micro-batch the engine switches the model's recompute (recompute.py), runs forward on the dict's local rows with the runtime's
CP attention over the dict's group, and backpropagates the unscaled token-loss sum; gradients accumulate and are
reduced once over the domain after the rank's last micro-batch, scaled by 1 / the global token count
(loss.py: exactly one device's gradient on the whole batch). Before a wave's first micro-batch the group's
members exchange one 1-element all-reduce: where a rank waits for slower new partners, measured, and where a
dead peer is named (CollectiveFailed with the rank, wave and group).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from dcp_megatron.core.global_batch import Documents
from dcp_megatron.core.microbatches import MICROBATCH_KEY
from dcp_megatron.core.step_loop import RanBatches, Share, StepRecord
from dcp_megatron.planner.plan import NO_RECOMPUTE
from dcp_megatron.runtime.cp_attention import cp_attention
from dcp_megatron.runtime.group_pool import GroupPool
from dcp_megatron.runtime.sharding import shard_microbatch
from tests.support.reference.loss import CollectiveFailed, StepLoss, reduce_step, token_loss_sum
from tests.support.reference.recompute import apply_recompute, current_recompute
from tests.support.reference.stats import RankTimes, StepStats, gather_step_stats

TokensOf = Callable[[int, int], torch.Tensor]  # (sample_id, length) -> LongTensor [length]


@dataclass(frozen=True)
class StepResult:
    loss: float          # global sum of token losses / global token count
    num_tokens: int      # global number of label tokens
    stats: StepStats | None


def documents_of(sequences: Sequence[tuple[int, int]], tokens_of: TokensOf) -> Documents:
    """[token, next token, loss mask] rows of `sequences`; a document's last token has no label (mask 0)."""
    pieces = []
    for sample_id, length in sequences:
        tokens = tokens_of(sample_id, length).to(torch.int64)
        labels = torch.cat([tokens[1:], tokens.new_zeros(1)])
        mask = torch.ones(length, dtype=torch.int64)
        mask[-1] = 0
        pieces.append(torch.stack([tokens, labels, mask], dim=1))
    rows = torch.cat(pieces) if pieces else torch.zeros(0, 3, dtype=torch.int64)
    return Documents(rows=rows, lengths=tuple(length for _, length in sequences))


def is_filler(batch: dict) -> bool:
    """A masked filler micro-batch (an idle rank's, or a schedule's multiple) rather than one of the plan's."""
    return not batch[MICROBATCH_KEY].router_documents.document_lengths


class ReferenceEngine:
    """TinyGPT steps on the loop's micro-batch dicts (see the module docstring): a `StepEngine`."""

    def __init__(self, model, *, pool: GroupPool, batches: Iterator[Sequence[tuple[int, int]]], tokens_of: TokensOf,
                 device: torch.device | str = "cpu", impl: str = "allgather", measure_waits: bool = True,
                 collect_stats: bool = True, trace: list | None = None,
                 before_microbatch: Callable[[dict], None] | None = None) -> None:
        self.model = model
        self.pool = pool
        self.batches = batches
        self.tokens_of = tokens_of
        self.device = torch.device(device)
        self.impl = impl
        self.measure_waits = measure_waits
        self.collect_stats = collect_stats
        # receives (wave index, CP size, CP rank, recompute the model ran, last of this rank) per micro-batch
        self.trace = trace
        self.before_microbatch = before_microbatch

    def read_share(self, num_samples: int):
        try:
            batch = list(next(self.batches))
        except StopIteration:
            return None, None
        domain_size, rank = self.pool.domain_size, self.pool.domain_rank
        return documents_of(batch[rank::domain_size], self.tokens_of), None

    def data_ended(self, iteration: int) -> None:
        raise RuntimeError(f"iteration {iteration}: no global batch left")

    def adapt_batches(self, batches: list[dict]) -> list[dict]:
        return batches

    def trace_target(self):
        return [], None

    def record(self, record: StepRecord) -> None:
        pass

    def run_batches(self, batches: list[dict], share: Share) -> RanBatches:
        started = time.perf_counter()
        plan = share.planned.plan
        num_waves = len(plan.waves)
        wave_wait_s, durations, loss = [0.0] * num_waves, [], StepLoss()
        planned = [b for b in batches if not is_filler(b)]
        last_wave = None
        for batch in batches:
            context = batch[MICROBATCH_KEY]
            if context.wave_index != last_wave and context.group is not None and self.measure_waits:
                wave_wait_s[context.wave_index] = self._wait_for_group(context)
            last_wave = context.wave_index
            if self.before_microbatch is not None:
                self.before_microbatch(batch)
            begun = time.perf_counter()
            loss_sum, num_tokens = self._forward(batch)
            loss_sum.backward()
            loss.add(loss_sum, num_tokens)
            durations.append(time.perf_counter() - begun)
            if self.trace is not None and not is_filler(batch):
                self.trace.append((context.wave_index, context.cp_size, context.cp_rank,
                                   str(current_recompute(self.model)), batch is planned[-1]))
        apply_recompute(self.model, NO_RECOMPUTE)
        reduced = time.perf_counter()
        step_loss, num_tokens = reduce_step(self.model.parameters(), loss, self.pool.domain_group)
        finished = time.perf_counter()
        stats = None
        if self.collect_stats:
            local = RankTimes(domain_rank=self.pool.domain_rank, num_microbatches=len(planned),
                              compute_s=sum(durations), wave_wait_s=tuple(wave_wait_s), reduce_s=finished - reduced,
                              step_s=finished - started)
            stats = gather_step_stats(local, plan, self.pool.domain_group, device=self.device)
        return RanBatches(durations=tuple(durations),
                          result=StepResult(loss=step_loss, num_tokens=num_tokens, stats=stats))

    def _forward(self, batch: dict) -> tuple[torch.Tensor, int]:
        """The micro-batch's unscaled token-loss sum on this rank's rows, and its label-token count."""
        context = batch[MICROBATCH_KEY]
        apply_recompute(self.model, context.recompute)
        bounds = batch["cu_seqlens"][0].tolist()
        lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
        shard = shard_microbatch(lengths, context.cp_size, context.cp_rank)
        attention = partial(cp_attention, shard=shard, group=context.group, impl=self.impl)
        logits = self.model(batch["tokens"][0], shard.position_ids, attention)
        mask = batch["loss_mask"][0] > 0
        labels = torch.where(mask, batch["labels"][0], torch.full_like(batch["labels"][0], -100))
        return token_loss_sum(logits, labels)

    def _wait_for_group(self, context) -> float:
        token = torch.zeros(1, device=self.device)
        started = time.perf_counter()
        first = self.pool.domain_rank - context.cp_rank
        try:
            dist.all_reduce(token, group=context.group)
        except RuntimeError as err:
            raise CollectiveFailed(
                f"domain rank {self.pool.domain_rank}: wave {context.wave_index} group of domain ranks "
                f"[{first}, {first + context.cp_size}) did not assemble — a peer rank died or did "
                f"not arrive within the group timeout ({self.pool.timeout.total_seconds():g} s): {err}") from err
        return time.perf_counter() - started
