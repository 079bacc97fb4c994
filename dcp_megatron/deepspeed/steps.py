"""The DeepSpeed adapter's per-step seam: the next global batch, its plan, and one planned engine step.

A DeepSpeed script keeps its own loop, engine, checkpoints and logging; per iteration it calls
`DcpSteps.train_step(engine)`, which

1. reads this rank's share of the next global batch from Megatron's data pipeline (`samples.py`:
   the samples Megatron's loop would train this step, cut into documents) and all-gathers the
   document lengths over the domain (`core/global_batch.py`), so every rank plans the same step
   from the same `(sequence_id, length)` list; plus one all-reduce of the step's loss-mask tokens;
2. plans it: by default while the previous step trained (`PlanAhead`: step k+1's share is read and its
   lengths gathered before step k trains); every rank plans the same step (`check_plans` proves it);
3. sends every document to the ranks whose micro-batches hold it (one all-to-all), builds this rank's
   batch dicts (`core/microbatches.py`: zig-zag shards, packed THD, CP group and recompute
   attached) and runs them on the engine (`engine_step.py`);
4. folds the measured micro-batch times into the cost model (one all-reduce; `refine`), writes the
   plan JSON (`dump_plans`, the Megatron path's format) with every rank's trace of what its micro-batches
   ran (CP group, recompute replayed: `core/microbatch_trace.py`) and returns what the step did.

The data position to checkpoint is Megatron's consumed-samples count of the first step not trained
yet (`state_dict`), also when the next step has already been read for planning ahead.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dcp_megatron.deepspeed.engine_step import StepOutcome, run_planned_step
from dcp_megatron.deepspeed.scalar_writers import write_step_to_monitor
from dcp_megatron.config import DcpConfig
from dcp_megatron.core.global_batch import DocumentIndex, Documents, exchange_documents, gather_lengths
from dcp_megatron.core.microbatch_trace import MicrobatchTrace
from dcp_megatron.core.microbatches import rank_batches
from dcp_megatron.core.plan_dump import PlanDumper
from dcp_megatron.core.planning import check_longest_fits, check_same_plan, plan_global_batch
from dcp_megatron.planner.ahead import PlanAhead, plan_synchronously
from dcp_megatron.planner.refine import TimeCorrection
from dcp_megatron.runtime.group_pool import plan_blocks
from dcp_megatron.runtime.measured_cost import refined_cost

_LOSS_MASK = 2   # column of a document row holding the loss mask (global_batch.ROW_FIELDS)


@dataclass(frozen=True)
class _Share:
    """One step's share of this rank, its domain-wide index and token count, and the data position before it."""

    step: int
    local: Documents
    index: DocumentIndex
    num_tokens: int        # loss-mask tokens of the whole global batch
    consumed_before: int   # samples consumed before this step


class DcpSteps:
    """Planned training steps over Megatron's samples (see the module docstring)."""

    def __init__(self, *, config: DcpConfig, shares, cost, pool, model_config, forward_loss, device,
                 is_logging_rank: bool) -> None:
        check_longest_fits(config, cost)
        self.config = config
        self.shares = shares      # samples.SampleShares of this rank
        self.pool = pool
        self.model_config = model_config
        self.forward_loss = forward_loss
        self.device = device
        self._base_cost = self._cost = cost
        self._correction = (TimeCorrection(cp_sizes=tuple(range(1, pool.domain_size + 1)))
                            if config.refine else None)
        self._dumper = PlanDumper(config.dump_plans) if config.dump_plans and is_logging_rank else None
        self._planner = PlanAhead(self._plan) if config.plan_ahead else None
        self._ahead: _Share | None = None   # the next step, read for planning ahead
        self._steps_run = 0
        self._next_step = 0
        self.last_plan = None
        self.last_planning = None   # PlannedStep of the last step: planning and exposed time

    def _plan(self, sequences, cost):
        return plan_global_batch(self.config, sequences, cost)

    def state_dict(self) -> dict:
        """The data position of the next step to train: Megatron's consumed samples."""
        consumed = self._ahead.consumed_before if self._ahead is not None else self.shares.consumed_samples
        return {"consumed_samples": consumed}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or not isinstance(state.get("consumed_samples"), int):
            raise ValueError(f"not a data position of this script: {state!r}")
        if self._ahead is not None:
            self._planner.discard()
            self._ahead = None
        self.shares.start(state["consumed_samples"])
        self._next_step = state["consumed_samples"] // self.shares.global_batch_size

    def _read(self) -> _Share | None:
        """This rank's share of the next step and the domain's lengths and tokens (collectives: every rank calls)."""
        consumed = self.shares.consumed_samples
        local = self.shares.next_share()
        if local is None:
            return None
        pool = self.pool
        index = DocumentIndex.build(gather_lengths(local.lengths, group=pool.domain_group,
                                                   domain_size=pool.domain_size))
        tokens = local.rows[:, _LOSS_MASK].sum().reshape(1).to(torch.int64)
        if pool.domain_size > 1:
            dist.all_reduce(tokens, group=pool.domain_group)
        share = _Share(step=self._next_step, local=local, index=index, num_tokens=int(tokens),
                       consumed_before=consumed)
        self._next_step += 1
        return share

    def _next(self):
        if self._ahead is not None:
            share, self._ahead = self._ahead, None
            return share, self._planner.result(share.step)
        share = self._read()
        if share is None:
            raise RuntimeError(f"the data ran out after {self.shares.consumed_samples} samples")
        return share, plan_synchronously(share.step, self._plan, share.index.sequences(), self._cost)

    def _read_ahead(self) -> None:
        share = self._read()
        if share is None:   # the data ends here: a further step would fail as it reads
            return
        self._ahead = share
        self._planner.submit(share.step, share.index.sequences(), self._cost)  # this step's cost model, passed

    def train_step(self, engine, *, last: bool = False) -> StepOutcome:
        """One planned step; `last`: the run's final step (nothing to read ahead after it)."""
        share, planned = self._next()
        if self._planner is not None and not last:
            self._read_ahead()
        plan = planned.plan
        if self.config.check_plans:
            check_same_plan(plan, iteration=share.step + 1, group=None, device=self.device)
        self.pool.ensure_groups(plan_blocks(plan))
        rank = self.pool.domain_rank
        documents = exchange_documents(plan, share.local, share.index, domain_rank=rank, group=self.pool.domain_group)
        batches = rank_batches(plan, documents, pool=self.pool, device=self.device)
        trace = None
        if self.config.dump_plans:   # what each micro-batch ran, next to the plans (core/microbatch_trace.py)
            trace = MicrobatchTrace(self.config.dump_plans, rank=dist.get_rank())
            trace.attach([engine.module], self.model_config, iteration=share.step + 1)
        try:
            outcome = run_planned_step(engine, batches, forward_loss=self.forward_loss, model_config=self.model_config,
                                       num_tokens=share.num_tokens, world_size=self.pool.domain_size)
        finally:
            if trace is not None:
                trace.detach()
        if self._correction is not None and self._steps_run > 0:  # the first step pays one-off start-up costs
            self._cost = refined_cost(self._correction, self._base_cost, plan, domain_rank=rank,
                                      durations=list(outcome.durations), device=self.device)
        self._steps_run += 1
        if self._dumper is not None:
            self._dumper.write(share.step + 1, plan)
        write_step_to_monitor(getattr(engine, "monitor", None), plan, step=share.step + 1, measured_s=outcome.seconds,
                              planned=planned, base_cost=self._base_cost, refining=self._correction is not None)
        self.last_plan, self.last_planning = plan, planned
        return outcome

    def close(self) -> None:
        if self._planner is not None:
            self._planner.close()

    @property
    def corrections(self) -> dict:
        return dict(self._correction.factors) if self._correction is not None else {}
