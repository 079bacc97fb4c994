"""The one planned-step loop both engines run: read, plan (ahead), agree, exchange, build, run, refine, record.

Per training step, on every rank of every DCP domain, `PlannedStepLoop.step` does what is the same for
megatron.training and DeepSpeed; an engine supplies only what is its own (`StepEngine`):

1. **read** this rank's share of the global batch (`engine.read_share`: Megatron pulls its data iterator on the
   model-parallel group's first rank and broadcasts; DeepSpeed cuts Megatron's samples) and all-gather the
   domain's lengths, so every rank plans the same `(sequence_id, length)` list;
2. **plan** it, by default one step ahead: step k+1's share is read before step k runs and planned on a worker
   thread while step k trains (`planner/ahead.py`), so a step waits only for planning that outlasts its
   predecessor's training. A step the engine runs again (Megatron's rerun state machine replaying an iteration)
   runs its first run's plan again: plans are pinned per iteration;
3. **agree**: one all-reduced plan hash over the world (`check_plans`): every rank runs the same plan, or all
   stop in one line naming the iteration;
4. **exchange** the documents to the ranks whose micro-batches hold them (one all-to-all over the domain) and
   **build** this rank's micro-batch dicts (`microbatches.rank_batches`: zig-zag shards, packed THD, CP group and
   recompute attached; `engine.adapt_batches` may add fillers, e.g. for virtual pipeline stages);
5. **run** them (`engine.run_batches`: Megatron's schedule with a forward step that feeds them; DeepSpeed's
   backward/step inside its reduction scopes), with the micro-batch trace attached when plans are dumped; an
   out-of-memory there becomes `MicrobatchOutOfMemory` naming the micro-batch (core/out_of_memory.py);
6. **refine**: once the engine has moved past a step (the next step starts: a rerun of it must see the same
   cost model), its measured micro-batch times correct the cost model identically on every rank (one
   all-reduce, `runtime/measured_cost.py`), and in the first steps its micro-batches' measured bytes correct the
   memory count (one MAX all-reduce, `runtime/measured_memory.py`; an engine's probe before step 1 calibrates it
   through `calibrate_memory`);
7. **record**: the plan JSON (`dump_plans`) and a `StepRecord` the engine writes as its scalars and log line.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Protocol

import torch

from dcp_megatron.config import DcpConfig, part_ranks_of
from dcp_megatron.core.global_batch import DocumentIndex, Documents, exchange_documents, gather_lengths
from dcp_megatron.core.microbatch_trace import MicrobatchTrace
from dcp_megatron.core.microbatches import MICROBATCH_KEY, rank_batches
from dcp_megatron.core.out_of_memory import (MICROBATCH, MicrobatchOutOfMemory, TrackedBatches, describe,
                                             injected_microbatch, phase_of)
from dcp_megatron.core.plan_dump import PlanDumper
from dcp_megatron.core.split_planning import SplitPlanner, planning_groups
from dcp_megatron.core.planning import check_longest_fits, check_same_plan, plan_global_batch
from dcp_megatron.planner.ahead import PlanAhead, PlannedStep, plan_synchronously
from dcp_megatron.planner.costmodel.memory_correction import (MemoryCorrection, MemoryReading, MemoryScale,
                                                              describe_scale, noise_floor_bytes)
from dcp_megatron.planner.costmodel.refine import TimeCorrection, relative_error
from dcp_megatron.runtime.group_pool import GroupPool, plan_blocks
from dcp_megatron.runtime.measured_cost import refined_cost
from dcp_megatron.runtime.measured_memory import PEAK, SAVED, fold_readings, refined_memory_scale


@dataclass(frozen=True)
class Share:
    """One step's share of this rank, the domain's index of its documents, and how it was read."""

    iteration: int
    local: Documents
    index: DocumentIndex
    num_samples: int              # what the engine read it with (Megatron: micro-batches per data-parallel rank)
    position: Any = None          # the engine's data position before it (DeepSpeed: samples consumed)
    read_ahead: bool = True       # read during the previous step (False: when this step started)
    planned: PlannedStep | None = None   # its plan once known: a rerun of the step runs it again


@dataclass(frozen=True)
class RanBatches:
    """What an engine's run of this rank's micro-batches returns to the loop."""

    durations: tuple[float, ...]  # seconds per micro-batch this rank timed (the cost model's refinement input)
    result: Any                   # the engine's own result, returned by `step` (Megatron's losses, a StepOutcome)
    memory_bytes: tuple[float, ...] | None = None   # each micro-batch's measured bytes, in plan order, when asked


@dataclass(frozen=True)
class StepRecord:
    """A step as the loop saw it, for the engine's scalars and log line."""

    iteration: int
    share: Share
    plan: Any                     # the StepPlan run
    planned: PlannedStep          # planning time, exposed time, ahead or not
    num_batches: int              # this rank's micro-batch dicts (fillers included)
    cp_sizes: tuple[int, ...]     # CP sizes of this rank's micro-batches
    before_run_s: float           # step start to the engine's run: waiting for the plan, exchange, batches
    measured_s: float             # step start to the end of the engine's run
    step_time_errors: tuple[float, ...]   # |predicted - measured| / measured, last 10 steps
    ran: RanBatches


class StepEngine(Protocol):
    """What an engine supplies to `PlannedStepLoop.step`."""

    def read_share(self, num_samples: int) -> tuple[Documents | None, Any]:
        """This rank's documents of the next step (None when the data ends) and the position before them.
        A collective where the engine's reading is (every rank calls it at the same point)."""

    def data_ended(self, iteration: int) -> None:
        """The current step found no data: raise the engine's end-of-data error."""

    def adapt_batches(self, batches: list[dict]) -> list[dict]:
        """This rank's micro-batch dicts as the engine's schedule must receive them (e.g. filler micro-batches)."""

    def run_batches(self, batches: list[dict], share: Share) -> RanBatches:
        """Forward and backward every micro-batch of this rank, and the engine's reduction and update."""

    def trace_target(self) -> tuple[list, Any]:
        """(model chunks, their TransformerConfig) the micro-batch trace attaches to."""

    def record(self, record: StepRecord) -> None:
        """The engine's scalars and log line of a finished step."""


class PlannedStepLoop:
    """The planned training step of one engine on this rank (see the module docstring)."""

    def __init__(self, *, config: DcpConfig, pool: GroupPool, cost, device, is_logging_rank: bool,
                 refine: bool = True, pad_multiple: int = 1, equal_rows: bool = False,
                 plan_function: Callable | None = None, measure_memory: bool = False) -> None:
        # a resumed run's count starts at the factors its out-of-memory records were counted with (their units)
        self._memory_correction = MemoryCorrection(factors=dict(config.recorded_memory_factors),
                                                   min_counted_bytes=noise_floor_bytes(cost))   # the noise guard
        scaled = (cost.with_memory_scale(self._memory_correction.scale()) if config.recorded_memory_factors
                  else cost)
        check_longest_fits(config, scaled)
        self.config = config
        self.pool = pool
        self.device = device
        self.pad_multiple = pad_multiple   # each document's rows a multiple of TP under sequence parallelism
        self.equal_rows = equal_rows       # one row count per lockstep wave (MoE token gathers over EP peers)
        self._plan_function = plan_function or self._default_plan_function(config, pool)
        self._base_cost, self._cost = cost, scaled
        self._correction = (TimeCorrection()
                            if config.refine and refine else None)
        self._dumper = PlanDumper(config.dump_plans) if config.dump_plans and is_logging_rank else None
        self._planner = PlanAhead(self._plan_function) if config.plan_ahead else None
        self._ahead: Share | None = None     # the next step, read (and being planned) during this one
        self._current: Share | None = None   # the step being run: a rerun of it reuses its share and plan
        # (iteration, plan, durations, memory readings or None) of the last step, to fold
        self._measured: tuple[int, Any, tuple[float, ...], tuple | None] | None = None
        self._steps_accepted = 0
        # the memory count's correction: calibrated by a probe, refined from the first steps' readings
        self._memory_steps_left = config.memory_refine_steps if measure_memory else 0
        self.memory_kind = PEAK if torch.device(device).type == "cuda" else SAVED
        self._errors: list[float] = []
        self.last_record: StepRecord | None = None

    @staticmethod
    def _default_plan_function(config: DcpConfig, pool: GroupPool) -> Callable:
        """The whole plan on every rank, or this rank's part of a large domain (core/split_planning.py): the
        planner's gloo groups are created here, by every rank of the world alike."""
        part_ranks = part_ranks_of(config, pool.domain_size)
        if config.policy != "dcp" or not part_ranks or pool.domain_size < 2 * part_ranks:
            return lambda sequences, cost: plan_global_batch(config, sequences, cost)
        group = planning_groups(pool.domains, timeout=pool.timeout)
        return SplitPlanner(policy=config.policy, max_seq_len=config.seq_length, part_ranks=part_ranks,
                            domain_rank=pool.domain_rank, group=group)

    # ---- what engines and tools read ----------------------------------------------------------------------
    @property
    def base_cost(self):
        """The cost model as configured (the refined one adds measured corrections)."""
        return self._base_cost

    @property
    def cost(self):
        return self._cost

    @property
    def refining(self) -> bool:
        return self._correction is not None

    @property
    def corrections(self) -> dict:
        """The measured corrections the cost model carries now: {(cp size, relief name): factor}."""
        return dict(self._correction.factors) if self._correction is not None else {}

    @property
    def memory_scale(self) -> MemoryScale:
        """The factors the memory count carries now (planner/costmodel/memory_correction.py)."""
        return self._memory_correction.scale()

    @property
    def memory_ratios(self) -> dict[str, float]:
        """The last measured / counted bytes per relief (the worst rank's), as folded into the memory count."""
        return dict(self._memory_correction.ratios)

    @property
    def memory_margin(self) -> float:
        return self._memory_correction.margin

    def memory_text(self) -> str:
        """The memory count's factors, margin and updates, for the log line."""
        correction = self._memory_correction
        return describe_scale(correction.scale(), correction.margin, correction.updates)

    def measures_memory(self) -> bool:
        """Whether the engine measures each micro-batch's memory in the step it runs next (the first steps)."""
        return self._memory_steps_left > 0

    def calibrate_memory(self, readings: list[MemoryReading], buckets: list[str]) -> MemoryScale:
        """Fold measured readings (a probe's) into the memory count before any plan is made: a MAX all-reduce over
        the world, so every rank must call it with the same `buckets`. Then `check_longest_fits`."""
        scale = fold_readings(self._memory_correction, readings, buckets, device=self.device)
        self._cost = self._cost.with_memory_scale(scale)
        return scale

    def check_longest_fits(self) -> None:
        """A --seq-length document must fit the corrected count too (DcpUsageError naming the flags)."""
        check_longest_fits(self.config, self._cost)

    def ahead_position(self) -> Any:
        """The data position before the step read ahead (None when none is)."""
        return self._ahead.position if self._ahead is not None else None

    def discard_ahead(self) -> None:
        """Forget the step read ahead (the engine moves its data position, e.g. on a resume)."""
        if self._ahead is not None:
            self._planner.discard()
            self._ahead = None

    def close(self) -> None:
        if self._planner is not None:
            self._planner.close()

    # ---- one step ------------------------------------------------------------------------------------------
    def step(self, engine: StepEngine, *, iteration: int, num_samples: int, next_num_samples: int | None):
        """Run training step `iteration` (1-based) on `engine`; `next_num_samples`: what the next step reads with,
        None when nothing is to be read ahead for it (the last step, or a step the engine reads itself)."""
        started = time.perf_counter()
        self._refine_with_accepted_step(iteration)
        share = self._this_steps_share(engine, iteration, num_samples)
        planned = share.planned
        plan = planned.plan
        if self._planner is not None and next_num_samples is not None:
            self._read_ahead(engine, iteration + 1, next_num_samples)
        if self.config.check_plans:   # over the world: every domain (TP peers, stages) must run this same plan
            check_same_plan(plan, iteration=iteration, group=None, device=self.device)
        pool = self.pool
        pool.ensure_groups(plan_blocks(plan))
        documents = exchange_documents(plan, share.local, share.index, domain_rank=pool.domain_rank,
                                       group=pool.domain_group)
        batches = rank_batches(plan, documents, pool=pool, device=self.device, pad_multiple=self.pad_multiple,
                               row_multiple=self.config.row_multiple, equal_rows=self.equal_rows)
        # the engine takes them from a tracked list: an out-of-memory names the micro-batch that was running
        batches = TrackedBatches(engine.adapt_batches(batches),
                                 inject_at=injected_microbatch(iteration, torch.distributed.get_rank(),
                                                               self.config.inject_out_of_memory_at))
        before_run_s = time.perf_counter() - started
        trace = None
        if self.config.dump_plans:   # what each micro-batch ran with, next to the plans (microbatch_trace.py)
            modules, model_config = engine.trace_target()
            trace = MicrobatchTrace(self.config.dump_plans, rank=torch.distributed.get_rank())
            trace.attach(modules, model_config, iteration=iteration)
        try:
            ran = engine.run_batches(batches, share)
        except torch.OutOfMemoryError as err:   # the count was low for this micro-batch: the engine's loop stops
            if phase_of(err) != MICROBATCH:   # the engine's optimizer step (DeepSpeed runs it here): named as such
                raise
            raise MicrobatchOutOfMemory(describe(
                plan, batches, iteration=iteration, rank=torch.distributed.get_rank(), domain_rank=pool.domain_rank,
                budget_bytes=self._cost.cluster.mem_budget_bytes, static_bytes=self._cost.static_bytes,
                memory_scale=self.memory_scale)) from err
        finally:
            if trace is not None:
                trace.detach()
        measured_s = time.perf_counter() - started
        self._errors = (self._errors + [relative_error(plan.est_step_time_s, measured_s)])[-10:]
        memory = None
        if self._memory_steps_left > 0:
            self._memory_steps_left -= 1
            memory = tuple(ran.memory_bytes or ())
        # a rerun of this step replaces its times and readings
        self._measured = (iteration, plan, tuple(ran.durations), memory)
        if self._dumper is not None:
            self._dumper.write(iteration, plan)
        record = StepRecord(iteration=iteration, share=share, plan=plan, planned=planned, num_batches=len(batches),
                            cp_sizes=tuple(sorted({b[MICROBATCH_KEY].cp_size for b in batches})),
                            before_run_s=before_run_s, measured_s=measured_s, step_time_errors=tuple(self._errors),
                            ran=ran)
        self.last_record = record
        engine.record(record)
        return ran.result

    def _refine_with_accepted_step(self, iteration: int) -> None:
        """Fold the last step's times into the cost model once the engine has moved past it (a collective).

        Refining right after a step would hand a rerun of it another cost model, so another plan: documents on
        other ranks and other per-rank values for Megatron to compare; a reproducible fault would read as
        transient. Every rank calls this at every step, so the all-reduce inside stays matched."""
        measured = self._measured
        if measured is None or measured[0] == iteration:
            return
        self._measured = None
        _, plan, durations, memory = measured
        cost = self._cost
        if self._correction is not None and self._steps_accepted > 0:  # the first step pays one-off start-up costs
            # over the world: TP peers and stages must plan alike too, so every rank gets the same sums
            cost = refined_cost(self._correction, self._base_cost, plan, domain_rank=self.pool.domain_rank,
                                durations=list(durations), device=self.device)
            if not self.memory_scale.is_identity:   # the time model is rebuilt from the base: keep the memory factors
                cost = cost.with_memory_scale(self.memory_scale)
        if memory is not None:   # a step that measured memory (the same steps on every rank): one MAX all-reduce
            cost = cost.with_memory_scale(refined_memory_scale(
                self._memory_correction, self._base_cost, plan, domain_rank=self.pool.domain_rank,
                measured=list(memory), kind=self.memory_kind, device=self.device))
        self._cost = cost
        self._steps_accepted += 1
        if memory is not None:
            self.check_longest_fits()

    def _this_steps_share(self, engine: StepEngine, iteration: int, num_samples: int) -> Share:
        """This step's share and plan: read and planned ahead during the last step, or now.

        An engine may run a step again, replaying the samples its first run pulled (Megatron's rerun state
        machine): a step that was read ahead pulled nothing of its own then (reuse what was read), one read at its
        start pulled its share first (read it again from the replay). A rerun runs its first run's plan."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.iteration == iteration:
            if ahead.num_samples != num_samples:
                raise AssertionError(f"iteration {iteration}: read ahead with {ahead.num_samples} samples per "
                                     f"data-parallel rank, the engine runs {num_samples}")
            self._current = replace(ahead, planned=_named_step(iteration, self._planner.result, iteration))
            return self._current
        if ahead is not None:
            self._planner.discard()
        current = self._current
        rerun = current is not None and current.iteration == iteration and current.planned is not None
        if rerun and current.read_ahead:
            return current
        local, position = engine.read_share(num_samples)
        if local is None:
            engine.data_ended(iteration)
            raise AssertionError(f"iteration {iteration}: the engine's data ended and data_ended() returned")
        index = self._gather_index(local)
        if rerun:
            if index.sequences() != current.index.sequences():
                raise AssertionError(f"iteration {iteration}: the rerun read other documents than the step's first "
                                     "run; a rerun must replay the same samples")
            return replace(current, local=local)
        planned = _named_step(iteration, plan_synchronously, iteration, self._plan_function, index.sequences(),
                              self._cost)
        self._current = Share(iteration=iteration, local=local, index=index, num_samples=num_samples,
                              position=position, read_ahead=False, planned=planned)
        return self._current

    def _read_ahead(self, engine: StepEngine, iteration: int, num_samples: int) -> None:
        """Read the next step's share now and start planning it (a collective: every rank calls it)."""
        local, position = engine.read_share(num_samples)
        if local is None:   # the data ends here: the next step reads (and fails) as the engine would
            return
        self._ahead = Share(iteration=iteration, local=local, index=self._gather_index(local),
                            num_samples=num_samples, position=position)
        self._planner.submit(iteration, self._ahead.index.sequences(), self._cost)  # today's cost model: no race

    def _gather_index(self, local: Documents) -> DocumentIndex:
        pool = self.pool
        return DocumentIndex.build(gather_lengths(local.lengths, group=pool.domain_group,
                                                  domain_size=pool.domain_size))


def _named_step(iteration: int, plan, *args):
    """plan(*args); a plan that cannot be made (the planner's ValueError) as a one-line DcpUsageError naming the
    step."""
    from dcp_megatron.config import DcpUsageError

    try:
        return plan(*args)
    except DcpUsageError:
        raise
    except ValueError as err:
        raise DcpUsageError(f"iteration {iteration}: no plan: {err}") from None
