"""The DeepSpeed adapter's per-step seam: the next global batch, its plan, and one planned engine step.

A DeepSpeed script keeps its own loop, engine, checkpoints and logging; per iteration it calls
`DcpSteps.train_step(engine)`, which runs the one planned-step loop both engines share
(dcp_megatron/core/step_loop.py: read, plan ahead, agree, exchange, build, run, refine, dump). What is
DeepSpeed's in it lives here and in `engine_step.py`:

- reading: this rank's share of the next global batch from Megatron's data pipeline (`samples.py`: the
  samples Megatron's loop would train this step, cut into documents), its data position kept so that
  `state_dict` is Megatron's consumed-samples count of the first step not trained yet, also when the next
  step has already been read for planning ahead;
- running: the step's micro-batches on the engine inside its reduction scopes, one update
  (`engine_step.py`), with the global batch's loss-mask tokens all-reduced over the domain for the
  per-token loss scale;
- recording: the step's scalars through the engine's monitor (`scalar_writers.py`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from dcp_megatron.config import DcpConfig
from dcp_megatron.core.step_loop import PlannedStepLoop, RanBatches, Share, StepRecord
from dcp_megatron.deepspeed.engine_step import StepOutcome, check_wave_reliefs, run_planned_step
from dcp_megatron.runtime.measured_memory import memory_readings
from dcp_megatron.deepspeed.scalar_writers import write_step_to_monitor

_LOSS_MASK = 2   # column of a document row holding the loss mask (global_batch.ROW_FIELDS)


class DcpSteps:
    """Planned training steps over Megatron's samples (see the module docstring)."""

    def __init__(self, *, config: DcpConfig, shares, cost, pool, model_config, forward_loss, device,
                 is_logging_rank: bool) -> None:
        self.shares = shares      # samples.SampleShares of this rank
        self.pool = pool
        self.model_config = model_config
        self.forward_loss = forward_loss
        memory_refine = torch.device(device).type == "cuda" if config.memory_refine is None else config.memory_refine
        self.loop = PlannedStepLoop(config=config, pool=pool, cost=cost, device=device,
                                    is_logging_rank=is_logging_rank, measure_memory=memory_refine)
        self._next_iteration = 1
        self.last_plan = None
        self.last_planning = None   # PlannedStep of the last step: planning and exposed time

    def state_dict(self) -> dict:
        """The data position of the next step to train: Megatron's consumed samples."""
        ahead = self.loop.ahead_position()
        return {"consumed_samples": ahead if ahead is not None else self.shares.consumed_samples}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or not isinstance(state.get("consumed_samples"), int):
            raise ValueError(f"not a data position of this script: {state!r}")
        self.loop.discard_ahead()
        self.shares.start(state["consumed_samples"])
        self._next_iteration = state["consumed_samples"] // self.shares.global_batch_size + 1

    def train_step(self, engine, *, last: bool = False) -> StepOutcome:
        """One planned step; `last`: the run's final step (nothing to read ahead after it)."""
        iteration, self._next_iteration = self._next_iteration, self._next_iteration + 1
        samples = self.shares.global_batch_size
        outcome = self.loop.step(_DeepSpeedStep(self, engine), iteration=iteration, num_samples=samples,
                                 next_num_samples=None if last else samples)
        record = self.loop.last_record
        self.last_plan, self.last_planning = record.plan, record.planned
        return outcome

    def close(self) -> None:
        self.loop.close()

    @property
    def corrections(self) -> dict:
        return self.loop.corrections


class _DeepSpeedStep:
    """What is DeepSpeed's in one planned step (core/step_loop.StepEngine): its samples, engine and monitor."""

    def __init__(self, owner: DcpSteps, engine) -> None:
        self.owner = owner
        self.engine = engine

    def read_share(self, num_samples: int):
        position = self.owner.shares.consumed_samples
        return self.owner.shares.next_share(), position

    def data_ended(self, iteration: int) -> None:
        raise RuntimeError(f"the data ran out after {self.owner.shares.consumed_samples} samples")

    def adapt_batches(self, batches: list[dict]) -> list[dict]:
        return batches

    def trace_target(self):
        return [self.engine.module], self.owner.model_config

    def run_batches(self, batches: list[dict], share: Share) -> RanBatches:
        pool = self.owner.pool
        if self.engine.zero_optimization_stage() == 3:   # before any collective: every rank holds this plan
            check_wave_reliefs(share.planned.plan, share.iteration)
        tokens = share.local.rows[:, _LOSS_MASK].sum().reshape(1).to(torch.int64)
        if pool.domain_size > 1:   # the global batch's loss tokens: the per-token loss scale
            dist.all_reduce(tokens, group=pool.domain_group)
        memory = (memory_readings(cuda=torch.cuda.is_available(), parameters=self.engine.module.parameters())
                  if self.owner.loop.measures_memory() else None)
        outcome = run_planned_step(self.engine, batches, forward_loss=self.owner.forward_loss,
                                   num_tokens=int(tokens), world_size=pool.domain_size, memory=memory)
        return RanBatches(durations=outcome.durations, result=outcome, memory_bytes=outcome.memory_bytes)

    def record(self, record: StepRecord) -> None:
        loop = self.owner.loop
        write_step_to_monitor(getattr(self.engine, "monitor", None), record.plan, step=record.iteration,
                              measured_s=record.ran.result.seconds, planned=record.planned,
                              base_cost=loop.base_cost, refining=loop.refining, memory_scale=loop.memory_scale,
                              memory_margin=loop.memory_margin)
