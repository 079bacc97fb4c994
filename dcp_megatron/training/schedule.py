"""DCP inside Megatron's training loop: the forward-backward function `train()` runs under `--dcp`.

megatron.training's `train()` asks `get_forward_backward_func()` once for the schedule it calls
every step with the step's data iterator and `num_microbatches = get_num_microbatches()`, the same
on every rank. Under `--dcp` (patches/training_training.py) it gets a `DcpForwardBackward` around
Megatron's own schedule (no pipelining, or 1F1B with PP 2), which per training step:

1. reads this data-parallel rank's share of the global batch from Megatron's iterator
   (`num_microbatches` pulls: exactly the samples Megatron would have trained this step) on the
   first rank of its model-parallel group (TP rank 0 of the first stage) and broadcasts the
   documents to the group's other TP ranks and stages, which then work alike on their own domain;
2. gathers every domain rank's lengths, plans the step (the same plan on every rank of every
   domain; by default planned during the previous step: step k+1's share is read and its lengths
   gathered before step k trains, and `PlanAhead` plans it on a worker thread while step k runs,
   so a step waits only for planning that outlasts the previous step's training), exchanges the
   documents (`global_batch.py`) and builds this rank's micro-batch dicts
   (`microbatches.py`; with sequence parallelism every document is padded so the rows split
   evenly over TP);
3. runs Megatron's schedule with THIS rank's count (ranks differ when PP = 1; with PP 2 the plan
   gives every rank one micro-batch per wave, and p2p shapes are exchanged per micro-batch) and a
   `DcpForwardStep` (`forward_step.py`) that feeds the user's forward step each micro-batch on
   every TP rank and switches its recompute on the model just before its forward;
4. times every micro-batch and, after one all-reduce of the sums, corrects the cost model the
   next plans use, identically on every rank (`planner/refine.py`; PP 1; `--dcp-no-refine` keeps it).
   Megatron's rerun state machine may run a step again (`--rerun-mode validate_results` on a suspect
   result): the rerun must replay the step, so a step's plan is pinned for its reruns and its times
   refine the cost model only once the step is accepted (when the next step starts);
5. leaves the loss to Megatron's `--calculate-per-token-loss` path: each micro-batch backpropagates
   its unscaled token-loss sum, `finalize_model_grads` all-reduces the token count over the data-
   parallel group (with Megatron's CP kept at 1, exactly the DCP domain) and divides: gradients
   are those of one device on the whole global batch.

Evaluation (`forward_only=True`) runs Megatron's schedule unchanged.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from datetime import timedelta
import torch

from dcp_megatron.training.batch_schedule import next_step_num_microbatches
from dcp_megatron.config import DcpConfig
from dcp_megatron.training.forward_step import DcpForwardStep
from dcp_megatron.core.global_batch import (DocumentIndex, Documents, broadcast_documents,
                                                exchange_documents, gather_lengths, split_samples)
from dcp_megatron.core.microbatch_trace import MicrobatchTrace
from dcp_megatron.core.microbatches import MICROBATCH_KEY, rank_batches, with_fillers_to_multiple
from dcp_megatron.core.plan_dump import PlanDumper
from dcp_megatron.core.plan_log import plan_summary
from dcp_megatron.core.planning import build_cost_model, check_longest_fits, check_same_plan, plan_global_batch
from dcp_megatron.core.recompute import restore_recompute, snapshot_recompute
from dcp_megatron.training.scalar_writers import megatron_writers_present, write_step
from dcp_megatron.planner.ahead import PlanAhead, PlannedStep, plan_synchronously
from dcp_megatron.planner.refine import TimeCorrection, relative_error
from dcp_megatron.planner.model import ModelShape
from dcp_megatron.runtime.group_pool import plan_blocks
from dcp_megatron.runtime.measured_cost import refined_cost


@dataclass(frozen=True)
class _ReadAhead:
    """The next step's share of the global batch, read (and its lengths gathered) one step early."""

    iteration: int
    local: Documents
    index: DocumentIndex
    read_ahead: bool = True   # read during the previous step (False: read when this step started)
    num_microbatches: int = 0   # Megatron's micro-batch count the share was read with (samples per DP rank)
    planned: PlannedStep | None = None   # the step's plan once known: a rerun of the step runs it again


@dataclass(frozen=True)
class _Measured:
    """A step's plan and this rank's micro-batch times, kept until the step is accepted (refines then)."""

    iteration: int
    plan: object
    durations: tuple[float, ...]


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
        self._pool = None
        self._cost = None
        self._dumper = None
        self._planner = None      # PlanAhead when planning one step ahead
        self._read_ahead = None   # _ReadAhead of the step being planned
        self._current = None      # _ReadAhead of the step being trained (a re-run of it reuses it)
        self._base_cost = None    # the cost model as configured; self._cost adds measured corrections
        self._correction = None   # TimeCorrection when refining
        self._errors: list[float] = []   # |predicted - measured| / measured step times, for the log
        self._steps_accepted = 0
        self._measured = None     # _Measured of the last step run, not yet folded into the cost model

    # Lazily, at the first training step: every rank of the world reaches it, in the same order.
    def _setup(self) -> None:
        from dcp_megatron.core.domain import build_group_pool

        self._pool = build_group_pool(tp_size=self.model_shape.tp, pp_size=self.model_shape.pp, timeout=self.timeout)
        self._cost = build_cost_model(self.config, self.model_shape, domain_size=self._pool.domain_size,
                                      has_gpu=self.has_gpu)
        self._base_cost = self._cost
        check_longest_fits(self.config, self._cost)
        if self.config.refine and self.model_shape.pp == 1:
            self._correction = TimeCorrection(cp_sizes=tuple(range(1, self._pool.domain_size + 1)))
        from megatron.core import parallel_state

        group = parallel_state.get_model_parallel_group()
        ranks = torch.distributed.get_process_group_ranks(group)
        # TP rank 0 of the first stage reads the data (Megatron builds datasets there).
        self._model_parallel_group = group if len(ranks) > 1 else None
        self._share_source_rank = min(ranks) if len(ranks) > 1 else None
        self._pad_multiple = self.model_shape.tp if self.sequence_parallel else 1
        if self.config.dump_plans and self.is_logging_rank:
            self._dumper = PlanDumper(self.config.dump_plans)
        if self.config.plan_ahead:
            self._planner = PlanAhead(self._plan)
        self._writes_scalars = megatron_writers_present()   # --tensorboard-dir / --wandb-project, last rank

    def _plan(self, sequences, cost):
        return plan_global_batch(self.config, sequences, cost)

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
        self._refine_with_accepted_step(iteration, device)

        local, index, planned = self._this_steps_plan(iteration, data_iterator, num_microbatches)
        plan = planned.plan
        if self._planner is not None and self._reads_ahead_for(iteration + 1):
            # the next step's own count: --step-batch-size-schedule may change it at that step
            self._plan_next_step(iteration + 1, data_iterator, next_step_num_microbatches(num_microbatches))
        if self.config.check_plans:
            # over the world: every domain (TP peers, stages) must run this same plan
            check_same_plan(plan, iteration=iteration, group=None, device=device)
        pool.ensure_groups(plan_blocks(plan))
        documents = exchange_documents(plan, local, index, domain_rank=pool.domain_rank, group=pool.domain_group)
        batches = rank_batches(plan, documents, pool=pool, device=device, pad_multiple=self._pad_multiple,
                               row_multiple=self.config.row_multiple, equal_rows=self.equal_rows_per_wave)
        if len(model_chunks) > 1:   # virtual pipeline stages: the interleaved schedule's micro-batch groups
            group_size = get_model_config(model_chunks[0]).microbatch_group_size_per_vp_stage
            batches = with_fillers_to_multiple(batches, group_size, device=device, pad_multiple=self._pad_multiple)
        planned_s = time.perf_counter() - started

        config = get_model_config(model_chunks[0])
        saved = snapshot_recompute(model_chunks, config), config.variable_seq_lengths
        step = DcpForwardStep(forward_step_func, batches, model_chunks=model_chunks, config=config,
                              cuda_events=self.has_gpu)
        # With PP, stages send activations of each micro-batch's own length: shapes go with them.
        config.variable_seq_lengths = config.variable_seq_lengths or self.model_shape.pp > 1
        trace = None
        if self.config.dump_plans:   # what each micro-batch ran with, next to the plans (microbatch_trace.py)
            trace = MicrobatchTrace(self.config.dump_plans, rank=torch.distributed.get_rank())
            trace.attach(model_chunks, config, iteration=iteration)
        try:
            data_iterators = [iter(()) for _ in model_chunks] if len(model_chunks) > 1 else iter(())
            losses_reduced = self.inner(forward_step_func=step, data_iterator=data_iterators, model=model,
                                        num_microbatches=len(batches), seq_length=seq_length,
                                        micro_batch_size=1, forward_only=False, **kwargs)
        finally:
            restore_recompute(model_chunks, config, saved[0])
            config.variable_seq_lengths = saved[1]
            if trace is not None:
                trace.detach()
        if step.num_run != len(batches) * len(model_chunks):
            raise AssertionError(f"the schedule ran {step.num_run} forward steps for this rank's {len(batches)} DCP "
                                 f"micro-batches on {len(model_chunks)} model chunks")
        measured_s = time.perf_counter() - started
        self._errors = (self._errors + [relative_error(plan.est_step_time_s, measured_s)])[-10:]
        # a rerun of this step replaces its first run's times
        self._measured = _Measured(iteration=iteration, plan=plan, durations=tuple(step.durations()))
        if self._dumper is not None:
            self._dumper.write(iteration, plan)
        if self._writes_scalars:
            write_step(plan, iteration=iteration, measured_s=measured_s, planning_s=planned.plan_s,
                       exposed_planning_s=planned.exposed_s, base_cost=self._base_cost,
                       refining=self._correction is not None, pad_multiple=self._pad_multiple)
        if self.is_logging_rank:
            if iteration % self.config.log_interval == 0:
                print(f" dcp iteration {iteration:8d} | {plan_summary(plan)} | predicted (ms): "
                      f"{plan.est_step_time_s * 1000:.1f} | forward-backward (ms): {measured_s * 1000:.1f} "
                      f"(before the schedule {planned_s * 1000:.1f}) | planning (ms): {planned.plan_s * 1000:.1f} "
                      f"{'ahead' if planned.ahead else 'at step start'}, exposed {planned.exposed_s * 1000:.1f} | "
                      f"step-time error {self._errors[-1]:.0%} (last {len(self._errors)}: mean "
                      f"{sum(self._errors) / len(self._errors):.0%}){self._factors_text()} | rank {pool.domain_rank} ran "
                      f"{len(batches)} micro-batches, cp sizes "
                      f"{sorted({b[MICROBATCH_KEY].cp_size for b in batches})} |", flush=True)
        return losses_reduced

    def _refine_with_accepted_step(self, iteration: int, device) -> None:
        """Fold the last step's times into the cost model once Megatron has moved past it (a collective).

        Refining right after a step would hand a rerun of it another cost model, so another plan: documents on
        other ranks and other per-rank values for Megatron to compare; a reproducible fault would read as
        transient. Every rank calls this at every training step, so the all-reduce inside stays matched."""
        measured = self._measured
        if measured is None or measured.iteration == iteration:
            return
        self._measured = None
        if self._correction is not None and self._steps_accepted > 0:  # the first step pays one-off start-up costs
            # over the world: TP peers and stages must plan alike too, so every rank gets the same sums
            self._cost = refined_cost(self._correction, self._base_cost, measured.plan,
                                      domain_rank=self._pool.domain_rank, durations=list(measured.durations),
                                      device=device)
        self._steps_accepted += 1

    def _factors_text(self) -> str:
        if self._correction is None or not self._correction.factors:
            return ""
        shown = ", ".join(f"cp{cp}/{kind} x{factor:.2f}" for (cp, kind), factor in sorted(self._correction.factors.items()))
        return f", measured corrections {shown}"

    def _this_steps_plan(self, iteration: int, data_iterator, num_microbatches: int
                         ) -> tuple[Documents, DocumentIndex, PlannedStep]:
        """This step's documents, their index and plan: planned ahead during the last step, or now.

        Megatron's rerun state machine may run a step again, replaying the samples pulled during its
        first run: a step that was read ahead pulled nothing of its own then (reuse what was read), one
        read at its start pulled its share first (read it again from the replay). A rerun runs the plan of
        the step's first run (pinned: a replay, not a new plan)."""
        ahead, self._read_ahead = self._read_ahead, None
        if ahead is not None and ahead.iteration == iteration:
            if ahead.num_microbatches != num_microbatches:
                raise AssertionError(f"iteration {iteration}: read ahead with {ahead.num_microbatches} micro-batches "
                                     f"per data-parallel rank, Megatron runs {num_microbatches}")
            self._current = replace(ahead, planned=self._planner.result(iteration))
            return ahead.local, ahead.index, self._current.planned
        if ahead is not None:
            self._planner.discard()
        current = self._current
        rerun = current is not None and current.iteration == iteration and current.planned is not None
        if rerun and current.read_ahead:
            return current.local, current.index, current.planned
        local = self._read_share(data_iterator, num_microbatches)
        if local is None:
            raise StopIteration
        index = self._gather_index(local)
        if rerun:
            if index.sequences() != current.index.sequences():
                raise AssertionError(f"iteration {iteration}: the rerun read other documents than the step's first "
                                     "run; Megatron's rerun must replay the same samples")
            return local, index, current.planned
        planned = plan_synchronously(iteration, self._plan, index.sequences(), self._cost)
        self._current = _ReadAhead(iteration=iteration, local=local, index=index, read_ahead=False,
                                   num_microbatches=num_microbatches, planned=planned)
        return local, index, planned

    def _reads_ahead_for(self, iteration: int) -> bool:
        """Whether to read and plan `iteration` during the step before it: not past the last step, and not for a
        step Megatron skips (`--iterations-to-skip`: its dummy step pulls that step's samples from the iterator
        itself, so reading them ahead would shift every later step onto the next step's samples)."""
        return ((self.config.train_iters is None or iteration <= self.config.train_iters)
                and iteration not in self.config.iterations_to_skip)

    def _plan_next_step(self, iteration: int, data_iterator, num_microbatches: int) -> None:
        """Read the next step's share now and start planning it (a collective: every rank calls it)."""
        local = self._read_share(data_iterator, num_microbatches)
        if local is None:  # the data ends here: the next step reads (and fails) as Megatron's would
            return
        index = self._gather_index(local)
        self._read_ahead = _ReadAhead(iteration=iteration, local=local, index=index,
                                      num_microbatches=num_microbatches)
        self._planner.submit(iteration, index.sequences(), self._cost)  # today's cost model, passed: no race

    def _gather_index(self, local: Documents) -> DocumentIndex:
        pool = self._pool
        return DocumentIndex.build(gather_lengths(local.lengths, group=pool.domain_group,
                                                  domain_size=pool.domain_size))

    def _read_share(self, data_iterator, num_microbatches: int) -> Documents | None:
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
