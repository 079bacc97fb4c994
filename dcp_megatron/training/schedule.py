"""DCP inside Megatron's training loop: the forward-backward function `train()` runs under `--dcp`.

megatron.training's `train()` asks `get_forward_backward_func()` once for the schedule it calls every step with
the step's data iterator and `num_microbatches = get_num_microbatches()`, the same on every rank. Under `--dcp`
(patches/training_training.py) it gets a `DcpForwardBackward` around Megatron's own schedule, which runs each
training step through the one planned-step loop both engines share (dcp_megatron/core/step_loop.py: read, plan
ahead, agree, exchange, build, run, refine, dump). What is Megatron's in it lives here:

- reading: this data-parallel rank's share is `num_microbatches` pulls of Megatron's iterator (exactly the
  samples Megatron would have trained this step) on the first rank of its model-parallel group (TP rank 0 of the
  first stage), broadcast to the group's other TP ranks and stages, which then work alike on their own domain;
  the next step's share is read with that step's own count (`--step-batch-size-schedule`), and not for a step
  Megatron skips (`--iterations-to-skip`) or past `--train-iters`;
- running: Megatron's schedule with THIS rank's count (ranks differ when PP = 1; with PP the plan gives every
  rank one micro-batch per wave, and p2p shapes are exchanged per micro-batch; virtual stages get masked fillers
  to the interleaved schedule's group size) and a `DcpForwardStep` (`forward_step.py`) that feeds the user's
  forward step each micro-batch on every TP rank and switches its recompute (and, on GPU, activation offload)
  just before its forward; with
  sequence parallelism every document is padded so the rows split evenly over TP;
- reruns: Megatron's rerun state machine may run a step again (`--rerun-mode validate_results`); the loop pins a
  step's plan for its reruns and refines the cost model only once the next step starts;
- the loss: Megatron's `--calculate-per-token-loss` path: each micro-batch backpropagates its unscaled token-loss
  sum, `finalize_model_grads` all-reduces the token count over the data-parallel group (with Megatron's CP kept at
  1, exactly the DCP domain) and divides: gradients are those of one device on the whole global batch;
- recording: Megatron's writers (`scalar_writers.py`) and the ` dcp iteration` log line. Refinement times
  micro-batches of one stage, so it runs with PP 1 only (`--dcp-no-refine` turns it off).

Evaluation (`forward_only=True`) runs Megatron's schedule unchanged.
"""
from __future__ import annotations

from datetime import timedelta

import torch

from dcp_megatron.config import DcpConfig
from dcp_megatron.core.global_batch import Documents, broadcast_documents, split_samples
from dcp_megatron.core.microbatches import with_fillers_to_multiple
from dcp_megatron.core.plan_log import dcp_iteration_line
from dcp_megatron.core.planning import build_cost_model
from dcp_megatron.core.offload import offload_built, own_warmup_every_step
from dcp_megatron.core.recompute import restore_recompute, snapshot_recompute
from dcp_megatron.core.step_loop import PlannedStepLoop, RanBatches, Share, StepRecord
from dcp_megatron.planner.costmodel import ModelShape
from dcp_megatron.runtime.measured_memory import memory_readings
from dcp_megatron.training.batch_schedule import next_step_num_microbatches
from dcp_megatron.training.forward_step import DcpForwardStep
from dcp_megatron.training.scalar_writers import megatron_writers_present, write_step


class DcpForwardBackward:
    """Megatron's forward-backward function with the step planned by DCP (see the module docstring)."""

    def __init__(self, inner, *, config: DcpConfig, model_shape: ModelShape, timeout: timedelta,
                 is_logging_rank: bool, has_gpu: bool, sequence_parallel: bool = False,
                 equal_rows_per_wave: bool = False) -> None:
        self.inner = inner
        self.config = config
        self.model_shape = model_shape
        self.timeout = timeout
        self.is_logging_rank = is_logging_rank
        self.has_gpu = has_gpu
        self.sequence_parallel = sequence_parallel
        self.equal_rows_per_wave = equal_rows_per_wave   # MoE token gathers over EP peers (moe_checks.py)
        self.loop: PlannedStepLoop | None = None

    # Lazily, at the first training step: every rank of the world reaches it, in the same order.
    def _setup(self) -> None:
        from megatron.core import parallel_state

        from dcp_megatron.core.domain import build_group_pool

        pool = build_group_pool(tp_size=self.model_shape.tp, pp_size=self.model_shape.pp, timeout=self.timeout)
        # on GPU: the device read now, the model, gradients and optimizer built (what is read and the budget: said once)
        cost = build_cost_model(self.config, self.model_shape, domain_size=pool.domain_size, has_gpu=self.has_gpu,
                                say=_say if self.is_logging_rank else None)
        device = torch.device("cuda", torch.cuda.current_device()) if self.has_gpu else torch.device("cpu")
        # refinement times micro-batches of one stage: with PP a micro-batch's time is spread over stages (and
        # several micro-batches are in flight: one reading per micro-batch needs PP 1 too)
        memory_refine = self.has_gpu if self.config.memory_refine is None else self.config.memory_refine
        self.loop = PlannedStepLoop(config=self.config, pool=pool, cost=cost, device=device,
                                    is_logging_rank=self.is_logging_rank, refine=self.model_shape.pp == 1,
                                    pad_multiple=self.model_shape.tp if self.sequence_parallel else 1,
                                    equal_rows=self.equal_rows_per_wave,
                                    measure_memory=memory_refine and self.model_shape.pp == 1)
        group = parallel_state.get_model_parallel_group()
        ranks = torch.distributed.get_process_group_ranks(group)
        # TP rank 0 of the first stage reads the data (Megatron builds datasets there).
        self._model_parallel_group = group if len(ranks) > 1 else None
        self._share_source_rank = min(ranks) if len(ranks) > 1 else None
        self._writes_scalars = megatron_writers_present()   # --tensorboard-dir / --wandb-project, last rank

    @property
    def corrections(self) -> dict:
        return self.loop.corrections if self.loop is not None else {}

    def __call__(self, *, forward_step_func, data_iterator, model, num_microbatches: int, seq_length: int,
                 micro_batch_size: int, forward_only: bool = False, **kwargs):
        if forward_only:
            return self.inner(forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                              num_microbatches=num_microbatches, seq_length=seq_length,
                              micro_batch_size=micro_batch_size, forward_only=True, **kwargs)
        if self.loop is None:
            self._setup()
            probe = self.has_gpu if self.config.memory_probe is None else self.config.memory_probe
            if probe and self.model_shape.pp == 1:   # before any plan is made: the count calibrated by a probe
                from dcp_megatron.training.memory_probe_run import probe_memory

                probe_memory(self.loop, forward_step_func, model if isinstance(model, list) else [model],
                             schedule=self.inner, seq_length=self.config.seq_length,
                             vocab_size=self.model_shape.vocab_size, is_logging_rank=self.is_logging_rank)
        iteration = self._iteration()
        engine = _MegatronStep(self, forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                               seq_length=seq_length, schedule_kwargs=kwargs)
        # the next step's own count: --step-batch-size-schedule may change it at that step
        ahead = (next_step_num_microbatches(num_microbatches)
                 if self.config.plan_ahead and self._reads_ahead_for(iteration + 1) else None)
        return self.loop.step(engine, iteration=iteration, num_samples=num_microbatches, next_num_samples=ahead)

    def _reads_ahead_for(self, iteration: int) -> bool:
        """Whether to read and plan `iteration` during the step before it: not past the last step, and not for a
        step Megatron skips (`--iterations-to-skip`: its dummy step pulls that step's samples from the iterator
        itself, so reading them ahead would shift every later step onto the next step's samples)."""
        return ((self.config.train_iters is None or iteration <= self.config.train_iters)
                and iteration not in self.config.iterations_to_skip)

    def read_share(self, data_iterator, num_microbatches: int) -> Documents | None:
        """This data-parallel rank's documents: read on its model-parallel group's first rank, broadcast.

        None on every rank of the group when the data ends (the source tells the others, so none waits)."""
        source = self._share_source_rank
        local = None
        if source is None or torch.distributed.get_rank() == source:
            if isinstance(data_iterator, list):
                # Virtual pipeline stages: one iterator per model chunk over the same samples; DCP reads the
                # global batch once, from the first, and hands every chunk the same micro-batches.
                data_iterator = data_iterator[0]
            if data_iterator is None:
                raise RuntimeError("--dcp: this rank reads the global batch but Megatron gave it no data iterator")
            try:
                local = split_samples([next(data_iterator) for _ in range(num_microbatches)])
            except StopIteration:
                local = None
        if source is not None:
            local = broadcast_documents(local, src=source, group=self._model_parallel_group)
        return local

    @staticmethod
    def _iteration() -> int:
        """The 1-based iteration Megatron is running (train() sets curr_iteration before each step)."""
        from megatron.training import get_args

        return int(get_args().curr_iteration) + 1


class _MegatronStep:
    """What is Megatron's in one planned step (core/step_loop.StepEngine): its iterator, schedule and writers."""

    def __init__(self, owner: DcpForwardBackward, *, forward_step_func, data_iterator, model, seq_length: int,
                 schedule_kwargs: dict) -> None:
        from megatron.core.utils import get_model_config

        self.owner = owner
        self.forward_step_func = forward_step_func
        self.data_iterator = data_iterator
        self.model = model
        self.model_chunks = model if isinstance(model, list) else [model]
        self.model_config = get_model_config(self.model_chunks[0])
        self.seq_length = seq_length
        self.schedule_kwargs = schedule_kwargs

    def read_share(self, num_samples: int):
        return self.owner.read_share(self.data_iterator, num_samples), None

    def data_ended(self, iteration: int) -> None:
        raise StopIteration

    def adapt_batches(self, batches: list[dict]) -> list[dict]:
        if len(self.model_chunks) > 1:   # virtual pipeline stages: the interleaved schedule's micro-batch groups
            group_size = self.model_config.microbatch_group_size_per_vp_stage
            batches = with_fillers_to_multiple(batches, group_size, device=self.owner.loop.device,
                                               pad_multiple=self.owner.loop.pad_multiple)
        return batches

    def trace_target(self):
        return self.model_chunks, self.model_config

    def run_batches(self, batches: list[dict], share: Share) -> RanBatches:
        """Megatron's own schedule over this rank's micro-batches, recompute switched per micro-batch."""
        config, chunks = self.model_config, self.model_chunks
        saved = snapshot_recompute(chunks), config.variable_seq_lengths
        loop = self.owner.loop
        memory = (memory_readings(cuda=self.owner.has_gpu, parameters=[p for c in chunks for p in c.parameters()])
                  if loop.measures_memory() and len(chunks) == 1 else None)
        step = DcpForwardStep(self.forward_step_func, batches, model_chunks=chunks, config=config,
                              cuda_events=self.owner.has_gpu, memory=memory,
                              saved_bytes_dir=self.owner.config.dump_saved_bytes)
        # With PP, stages send activations of each micro-batch's own length: shapes go with them.
        config.variable_seq_lengths = config.variable_seq_lengths or self.owner.model_shape.pp > 1
        if offload_built(config):   # GPU: this step's micro-batches and offload sets are its own
            own_warmup_every_step()
        try:
            data_iterators = [iter(()) for _ in chunks] if len(chunks) > 1 else iter(())
            losses_reduced = self.owner.inner(forward_step_func=step, data_iterator=data_iterators, model=self.model,
                                              num_microbatches=len(batches), seq_length=self.seq_length,
                                              micro_batch_size=1, forward_only=False, **self.schedule_kwargs)
        finally:
            restore_recompute(chunks, saved[0])
            config.variable_seq_lengths = saved[1]
        if step.num_run != len(batches) * len(chunks):
            raise AssertionError(f"the schedule ran {step.num_run} forward steps for this rank's {len(batches)} DCP "
                                 f"micro-batches on {len(chunks)} model chunks")
        return RanBatches(durations=tuple(step.durations()), result=losses_reduced,
                          memory_bytes=tuple(step.memory_readings()) if memory is not None else None)

    def record(self, record: StepRecord) -> None:
        owner, loop, plan, planned = self.owner, self.owner.loop, record.plan, record.planned
        if owner._writes_scalars:
            write_step(plan, iteration=record.iteration, measured_s=record.measured_s, planning_s=planned.plan_s,
                       exposed_planning_s=planned.exposed_s, base_cost=loop.base_cost, refining=loop.refining,
                       pad_multiple=loop.pad_multiple, memory_scale=loop.memory_scale,
                       memory_margin=loop.memory_margin)
        if owner.is_logging_rank and record.iteration % owner.config.log_interval == 0:
            print(dcp_iteration_line(record, forward_backward_s=record.measured_s, domain_rank=loop.pool.domain_rank,
                                     corrections=loop.corrections,
                                     memory=loop.memory_text()), flush=True)


def _say(line: str) -> None:
    print(line, flush=True)
