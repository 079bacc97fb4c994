"""The DeepSpeed adapter's per-step seam: the next global batch, its plan, and one planned engine step.

A DeepSpeed script keeps its own loop, engine, checkpoints and logging; per iteration it calls
`DcpSteps.train_step(engine)`, which

1. takes the next global batch from the run's `GlobalBatchStream` (a token budget of documents, the
   same batches for every world size, so runs of different layouts see the same data); every rank
   holds the stream, so every rank knows every step's lengths without communicating;
2. plans it: by default while the previous step trained (`PlanAhead`: step k+1's lengths are known
   before step k starts, so planning is exposed only when it outlasts a step); every rank plans the
   same step from the same lengths and cost model (`check_plans` proves it);
3. reads the documents of this rank's micro-batches only (`data/assembly.py`), builds its batch dicts
   (`megatron/microbatches.py`: zig-zag shards, packed THD, CP group and recompute attached) and runs
   them on the engine (`engine_step.py`);
4. folds the measured micro-batch times into the cost model (one all-reduce; `refine`), writes the
   plan JSON (`dump_plans`, the Megatron path's format) and returns what the step did.

The data position to checkpoint is that of the first batch not trained yet (`state_dict`), also
when the next batch has already been read for planning ahead.
"""
from __future__ import annotations


from dcp_megatron.data.assembly import document_rows
from dcp_megatron.deepspeed.engine_step import StepOutcome, run_planned_step
from dcp_megatron.deepspeed.scalar_writers import write_step_to_monitor
from dcp_megatron.megatron.dcp_args import DcpConfig
from dcp_megatron.megatron.global_batch import documents_needed
from dcp_megatron.megatron.microbatches import rank_batches
from dcp_megatron.megatron.plan_dump import PlanDumper
from dcp_megatron.megatron.planning import check_longest_fits, check_same_plan, plan_global_batch
from dcp_megatron.planner.ahead import PlanAhead, plan_synchronously
from dcp_megatron.planner.refine import TimeCorrection
from dcp_megatron.runtime.group_pool import plan_blocks
from dcp_megatron.runtime.measured_cost import refined_cost


class DcpSteps:
    """Planned training steps over a global-batch stream (see the module docstring)."""

    def __init__(self, *, config: DcpConfig, stream, source, cost, pool, model_config, forward_loss, device,
                 is_logging_rank: bool) -> None:
        check_longest_fits(config, cost)
        self.config = config
        self.stream = stream
        self.source = source
        self.pool = pool
        self.model_config = model_config
        self.forward_loss = forward_loss
        self.device = device
        self._base_cost = self._cost = cost
        self._correction = (TimeCorrection(cp_sizes=tuple(range(1, pool.domain_size + 1)))
                            if config.refine else None)
        self._dumper = PlanDumper(config.dump_plans) if config.dump_plans and is_logging_rank else None
        self._planner = PlanAhead(self._plan) if config.plan_ahead else None
        self._ahead = None          # (batch, stream state before it) read for planning ahead
        self._steps_run = 0
        self.last_plan = None
        self.last_planning = None   # PlannedStep of the last step: planning and exposed time

    def _plan(self, sequences, cost):
        return plan_global_batch(self.config, sequences, cost)

    def state_dict(self) -> dict:
        """The data position of the next step to train."""
        return self._ahead[1] if self._ahead is not None else self.stream.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if self._ahead is not None:
            self._planner.discard()
            self._ahead = None
        self.stream.load_state_dict(state)

    def _next_batch(self):
        if self._ahead is not None:
            (batch, _), self._ahead = self._ahead, None
            return batch, self._planner.result(batch.step)
        batch = self.stream.next_batch()
        return batch, plan_synchronously(batch.step, self._plan, list(batch.sequences), self._cost)

    def _read_ahead(self) -> None:
        state = self.stream.state_dict()
        batch = self.stream.next_batch()
        self._ahead = (batch, state)
        self._planner.submit(batch.step, list(batch.sequences), self._cost)  # this step's cost model, passed

    def train_step(self, engine) -> StepOutcome:
        batch, planned = self._next_batch()
        if self._planner is not None:
            self._read_ahead()
        plan = planned.plan
        if self.config.check_plans:
            check_same_plan(plan, iteration=batch.step + 1, group=None, device=self.device)
        self.pool.ensure_groups(plan_blocks(plan))
        rank = self.pool.domain_rank
        lengths = dict(batch.sequences)
        documents = {sid: document_rows(self.source, batch, sid, lengths[sid]) for sid in documents_needed(plan, rank)}
        batches = rank_batches(plan, documents, pool=self.pool, device=self.device)
        outcome = run_planned_step(engine, batches, forward_loss=self.forward_loss, model_config=self.model_config,
                                   num_tokens=batch.num_tokens, world_size=self.pool.domain_size)
        if self._correction is not None and self._steps_run > 0:  # the first step pays one-off start-up costs
            self._cost = refined_cost(self._correction, self._base_cost, plan, domain_rank=rank,
                                      durations=list(outcome.durations), device=self.device)
        self._steps_run += 1
        if self._dumper is not None:
            self._dumper.write(batch.step + 1, plan)
        write_step_to_monitor(getattr(engine, "monitor", None), plan, step=batch.step + 1, measured_s=outcome.seconds,
                              planned=planned, base_cost=self._base_cost, refining=self._correction is not None)
        self.last_plan, self.last_planning = plan, planned
        return outcome

    def close(self) -> None:
        if self._planner is not None:
            self._planner.close()

    @property
    def corrections(self) -> dict:
        return dict(self._correction.factors) if self._correction is not None else {}
