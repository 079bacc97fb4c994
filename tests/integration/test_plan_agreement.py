"""Both training loops under --dcp keep their ranks on one plan (one pytest process, two gloo ranks).

Megatron's (`DcpForwardBackward`): the real forward-backward function around a stand-in for Megatron's schedule
(it calls the forward step once per micro-batch; the user's forward step only records what it was handed and
takes a rank's own time), with Megatron's model-parallel state and a tiny GPT model:

- a rank that plans differently (another --dcp-policy, as a rank started with other flags would) stops every
  rank at that step in one line naming the disagreement, before any document moves (no hang);
- ranks that measure very different micro-batch times still hold the same refined cost model (the all-reduce in
  runtime/measured_cost.py), so their plans keep agreeing;
- a rerun of a step (Megatron's rerun state machine calls the function again for the same iteration, replaying
  its samples) runs the plan of the step's first run, and the cost model changes only once the step is accepted.

DeepSpeed's (`DcpSteps`, around a stand-in ZeRO-0 engine): the same disagreement stops it the same way, and ranks
timing differently keep one cost model.

All four cases run in one launch (`results`), one after the other, each setting up and tearing down its own
model-parallel state: a launch's start-up (imports) is most of its cost.
"""
from __future__ import annotations

import argparse
from datetime import timedelta

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.support.dist_utils import run_distributed  # noqa: E402

SEQ = 64
STEPS = (1, 2, 3, 3, 4)      # iteration of each call: step 3 is run again (a rerun)


def _samples(step: int, rank: int, count: int) -> list[dict]:
    """Mock Megatron samples of SEQ tokens, each cut into documents (`cu_seqlens`), different per step and rank."""
    generator = torch.Generator().manual_seed(100 * step + rank)
    samples = []
    for _ in range(count):
        cuts = sorted(torch.randperm(SEQ - 1, generator=generator)[:2].add(1).tolist())
        bounds = [0, *cuts, SEQ]
        tokens = torch.randint(0, 64, (1, SEQ), generator=generator)
        cu = torch.full((1, SEQ + 1), SEQ, dtype=torch.int32)
        cu[0, :len(bounds)] = torch.tensor(bounds, dtype=torch.int32)
        samples.append({"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(1, SEQ), "cu_seqlens": cu})
    return samples


def _loop_worker(rank: int, world_size: int, case: str) -> dict:
    import time

    from megatron.core import parallel_state
    from megatron.training import global_vars

    from dcp_megatron.config import DcpConfig
    from dcp_megatron.core.microbatches import MICROBATCH_KEY
    from patches.megatron_set import megatron_patch_registry
    from dcp_megatron.training.schedule import DcpForwardBackward
    from dcp_megatron.planner.costmodel import ModelShape
    from tests.support.megatron_runs import tiny_local_gpt

    seen: list = []
    slow_s = 0.02 if rank == 1 else 0.0   # rank 1 measures every micro-batch much slower

    def user_forward_step(data_iterator, model):
        batch = next(data_iterator)
        context = batch[MICROBATCH_KEY]
        seen[-1].append((context.wave_index, context.cp_size, str(context.recompute), batch["tokens"].tolist()))
        time.sleep(slow_s)
        return None, None

    def schedule(*, forward_step_func, data_iterator, model, num_microbatches, **kwargs):
        # the cost model's corrections this step was planned with
        result["factors_used"].append(loop.corrections)
        for _ in range(num_microbatches):
            forward_step_func(data_iterator, model)
        return []

    with megatron_patch_registry():
        parallel_state.initialize_model_parallel()
        model = tiny_local_gpt(num_layers=2, max_sequence_length=SEQ)
        args = argparse.Namespace(curr_iteration=0)
        global_vars.set_args(args)
        policy = "static" if case == "disagree" and rank == 1 else "dcp"
        config = DcpConfig(seq_length=SEQ, policy=policy, plan_ahead=False, refine=True, memory_budget_gb=0.0005)
        shape = ModelShape(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=4, head_dim=8, ffn_hidden_size=128,
                           vocab_size=64, gated_mlp=False)
        loop = DcpForwardBackward(schedule, config=config, model_shape=shape, timeout=timedelta(seconds=20),
                                  is_logging_rank=False, has_gpu=False)
        result = {"calls": [], "factors_used": []}
        try:
            for step in STEPS:
                args.curr_iteration = step - 1
                seen.append([])
                loop(forward_step_func=user_forward_step, data_iterator=iter(_samples(step, rank, 4)), model=model,
                     num_microbatches=4, seq_length=SEQ, micro_batch_size=1)
                result["calls"].append(seen[-1])
        except RuntimeError as err:
            result["error"] = str(err)
        result["factors"] = sorted(loop.corrections.items()) if loop.loop.refining else None
        parallel_state.destroy_model_parallel()
    return result


# (loop, case) in the order the launch runs them: the cases that train first, then the ones that stop
CASES = (("megatron", "refine"), ("deepspeed", "refine"), ("megatron", "disagree"), ("deepspeed", "disagree"))


def _all_cases_worker(rank: int, world_size: int) -> dict:
    workers = {"megatron": _loop_worker, "deepspeed": _deepspeed_loop_worker}
    return {f"{loop}/{case}": workers[loop](rank, world_size, case) for loop, case in CASES}


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict]]:
    """"loop/case" -> each rank's result."""
    per_rank = run_distributed(_all_cases_worker, 2, timeout_s=480, group_timeout_s=30)
    return {key: [ranks[key] for ranks in per_rank] for key in per_rank[0]}


def test_a_rank_with_another_plan_stops_every_rank_in_one_line_naming_it(results):
    results = results["megatron/disagree"]
    for rank, result in enumerate(results):
        error = result.get("error", "")
        assert error.startswith("iteration 1: ranks computed different plans") and "\n" not in error, (rank, result)
        assert result["calls"] == [], "a step ran on plans the ranks disagree on"


def test_ranks_timing_differently_keep_one_cost_model_and_a_rerun_replays_its_plan(results):
    results = results["megatron/refine"]
    for rank, result in enumerate(results):
        assert "error" not in result, (rank, result.get("error"))
        assert len(result["calls"]) == len(STEPS)
    # refinement ran (steps 2 and 3 were folded in) and left both ranks with the same corrections
    assert results[0]["factors"] and results[0]["factors"] == results[1]["factors"], [r["factors"] for r in results]
    first, rerun = STEPS.index(3), len(STEPS) - 1 - STEPS[::-1].index(3)
    for rank, result in enumerate(results):
        # the rerun ran the first run's micro-batches (documents, CP sizes, recompute), in the same order
        assert result["calls"][rerun] == result["calls"][first], rank
        # and the cost model did not change between the two: step 3's times wait until step 4 starts
        used = result["factors_used"]
        assert used[rerun] == used[first], (rank, used)
        assert used[first] and used[-1] != used[first], (rank, used)


class _Shares:
    """Stands for deepspeed/samples.SampleShares: this rank's documents of each step, in order."""

    global_batch_size = 8

    def __init__(self, rank: int) -> None:
        self.rank, self.consumed_samples = rank, 0

    def next_share(self):
        from dcp_megatron.core.global_batch import split_samples

        step = self.consumed_samples // self.global_batch_size + 1
        self.consumed_samples += self.global_batch_size
        return split_samples(_samples(step, self.rank, 4))


class _Engine:
    """Stands for a ZeRO-0 DeepSpeed engine: backward on the loss, an update that only clears the gradients."""

    def __init__(self, module) -> None:
        self.module = module

    def zero_optimization_stage(self) -> int:
        return 0

    def no_sync(self):
        import contextlib

        return contextlib.nullcontext()

    def backward(self, loss, scale_wrt_gas=True) -> None:
        loss.backward()

    def step(self) -> None:
        for p in self.module.parameters():
            p.grad = None

    def get_global_grad_norm(self):
        return None


def _deepspeed_loop_worker(rank: int, world_size: int, case: str) -> dict:
    import time

    from megatron.core import parallel_state

    from dcp_megatron.deepspeed.steps import DcpSteps
    from dcp_megatron.config import DcpConfig
    from patches.megatron_set import megatron_patch_registry
    from dcp_megatron.core.planning import build_cost_model
    from dcp_megatron.planner.costmodel import ModelShape
    from dcp_megatron.runtime.group_pool import GroupPool
    from tests.support.megatron_runs import tiny_local_gpt

    slow_s = 0.02 if rank == 1 else 0.0

    def forward_loss(engine, batch):
        # the loss reaches every weight (a gradient to reduce) and counts the batch's real tokens
        time.sleep(slow_s)
        valid = int(batch["loss_mask"].sum())
        touch = sum(p.sum() for p in engine.module.parameters()) * 0.0
        return touch + float(valid), valid

    with megatron_patch_registry():
        parallel_state.initialize_model_parallel()
        model = tiny_local_gpt(num_layers=2, max_sequence_length=SEQ)
        policy = "static" if case == "disagree" and rank == 1 else "dcp"
        config = DcpConfig(seq_length=SEQ, policy=policy, plan_ahead=False, refine=True, memory_budget_gb=0.0005)
        shape = ModelShape(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=4, head_dim=8, ffn_hidden_size=128,
                           vocab_size=64, gated_mlp=False)
        cost = build_cost_model(config, shape, domain_size=2, has_gpu=False)
        pool = GroupPool([[0, 1]], timeout=timedelta(seconds=20))
        steps = DcpSteps(config=config, shares=_Shares(rank), cost=cost, pool=pool, model_config=model.config,
                         forward_loss=forward_loss, device=torch.device("cpu"), is_logging_rank=False)
        result = {"steps": 0}
        try:
            for _ in range(4):
                steps.train_step(_Engine(model))
                result["steps"] += 1
        except RuntimeError as err:
            result["error"] = str(err)
        result["factors"] = sorted(steps.corrections.items())
        steps.close()
        parallel_state.destroy_model_parallel()
    return result


def test_deepspeed_steps_a_rank_with_another_plan_stops_every_rank_in_one_line_naming_it(results):
    results = results["deepspeed/disagree"]
    for rank, result in enumerate(results):
        error = result.get("error", "")
        assert error.startswith("iteration 1: ranks computed different plans") and "\n" not in error, (rank, result)
        assert result["steps"] == 0


def test_deepspeed_steps_ranks_timing_differently_keep_one_cost_model(results):
    results = results["deepspeed/refine"]
    assert all("error" not in r and r["steps"] == 4 for r in results), results
    assert results[0]["factors"] and results[0]["factors"] == results[1]["factors"], results
