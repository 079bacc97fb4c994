"""Exactness and speed harness on the loop users run: TinyGPT steps through `PlannedStepLoop` and the
`ReferenceEngine` (engine.py), next to the single-process reference (single_process.py).

Shared by tests/integration/test_runtime_parity.py, tools/check_parity.py and tools/bench_runtime.py:
- `ReferenceRun` trains a TinyGPT over a list of global batches with any plan maker (the planner's policies,
  or `single_process.random_plan` for layouts the planner would not pick), one `step()` per batch, planning
  one step ahead as a training run does;
- `parity_case` runs one random layout on this rank and the single-process reference (every rank computes
  both) and compares every parameter's gradient.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Callable, Sequence

import torch

from dcp_megatron.config import DcpConfig
from dcp_megatron.core.step_loop import PlannedStepLoop
from dcp_megatron.planner.costmodel import CostModel, ModelShape, cpu_cluster
from dcp_megatron.runtime.group_pool import GroupPool
from tests.support.reference.engine import ReferenceEngine, StepResult, TokensOf
from tests.support.reference.single_process import grad_max_rel_err, random_plan, reference_train_step, seeded_tokens
from tests.support.reference.tiny_gpt import TinyGPT, TinyGPTConfig

PlanFunction = Callable[[list, CostModel], object]   # (loop's (id, length) sequences, cost model) -> StepPlan


def tiny_shape(config: TinyGPTConfig) -> ModelShape:
    """The planner's view of a TinyGPT."""
    return ModelShape(num_layers=config.num_layers, hidden_size=config.hidden_size, num_heads=config.num_heads,
                      num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                      ffn_hidden_size=config.ffn_hidden_size, vocab_size=config.vocab_size)


def roomy_cost(config: TinyGPTConfig, domain_size: int) -> CostModel:
    """CPU physics for `config` with memory to spare: any layout fits (plans that are not the planner's)."""
    cluster = dataclasses.replace(cpu_cluster(domain_size), mem_bytes_per_gpu=64 * 2 ** 30)
    return CostModel(tiny_shape(config), cluster)


class ReferenceRun:
    """TinyGPT training over `batches` on this rank through the planned-step loop (module docstring)."""

    def __init__(self, model: TinyGPT, pool: GroupPool, batches: Sequence[Sequence[tuple[int, int]]],
                 tokens_of: TokensOf, *, plan_function: PlanFunction, cost: CostModel, seq_length: int,
                 plan_ahead: bool = True, check_plans: bool = True, impl: str = "allgather",
                 measure_waits: bool = True, collect_stats: bool = True,
                 before_microbatch: Callable[[dict], None] | None = None) -> None:
        config = DcpConfig(seq_length=seq_length, plan_ahead=plan_ahead, refine=False, check_plans=check_plans)
        self.loop = PlannedStepLoop(config=config, pool=pool, cost=cost, device=torch.device("cpu"),
                                    is_logging_rank=False, plan_function=plan_function)
        self.engine = ReferenceEngine(model, pool=pool, batches=iter(batches), tokens_of=tokens_of, impl=impl,
                                      measure_waits=measure_waits, collect_stats=collect_stats,
                                      before_microbatch=before_microbatch)
        self.num_steps = len(batches)
        self.iteration = 0

    def step(self, *, trace: list | None = None) -> StepResult:
        """The next batch's step: forward/backward of this rank's micro-batches, then the deferred reduction.
        `trace` receives (wave index, CP size, CP rank, recompute the model ran, last of this rank) per
        micro-batch of the plan: evidence of which dynamic path actually ran."""
        self.iteration += 1
        self.engine.trace = trace
        more = self.iteration < self.num_steps
        return self.loop.step(self.engine, iteration=self.iteration, num_samples=1,
                              next_num_samples=1 if more else None)

    @property
    def last_plan(self):
        return self.loop.last_record.plan

    def close(self) -> None:
        self.loop.close()


def parity_case(pool: GroupPool, case_seed: int, *, impl: str = "allgather", max_seq_len: int = 48) -> dict:
    """One random layout on this rank vs the single-process reference (every rank computes both).

    Returns {"max_rel_err", "loss", "ref_loss", "trace", "plan"}; identical on every rank except trace."""
    rng = random.Random(case_seed)
    domain_size = pool.domain_size
    config = TinyGPTConfig(vocab_size=64, num_layers=rng.choice((1, 2, 3)), hidden_size=32, num_heads=4,
                           num_kv_heads=rng.choice((1, 2)), ffn_hidden_size=48)  # GQA: 4 query heads per 1 or 2
    batch = [(sample_id, rng.randint(1, max_seq_len)) for sample_id in range(rng.randint(domain_size, 3 * domain_size))]
    tokens_of = seeded_tokens(config.vocab_size, case_seed)
    model = TinyGPT(config, seed=case_seed)
    reference = TinyGPT(config, seed=case_seed)

    def plan_function(sequences, cost):
        return random_plan(sequences, domain_size, rng, num_layers=config.num_layers)

    run = ReferenceRun(model, pool, [batch], tokens_of, plan_function=plan_function, seq_length=max_seq_len,
                       cost=roomy_cost(config, domain_size), impl=impl)
    trace: list = []
    result = run.step(trace=trace)
    run.close()
    ref_loss = reference_train_step(reference, batch, tokens_of)
    return {"max_rel_err": grad_max_rel_err(model, reference), "loss": result.loss, "ref_loss": ref_loss,
            "trace": trace, "plan": run.last_plan.dumps()}
