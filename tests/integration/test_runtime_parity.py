"""Proof of exactness of the planned-step loop users run (core/step_loop.py, with the reference engine:
TinyGPT where Megatron's schedule or DeepSpeed's engine would be): any layout gives the single-device gradient
and loss.

Launches (gloo, CPU; many cases each, launches are import-bound):
- world 4 and world 3: random layouts built directly as StepPlans (mixed CP sizes in one wave,
  several micro-batches on some groups and one or none on others, random recompute per
  micro-batch, GQA, both CP attention variants), every parameter's gradient vs the
  single-process full-batch reference; then 20 training steps with the planner's `dcp` policy
  on a cpu ClusterSpec vs single-process training, loss traces compared step by step.
- world 3: a rank dies mid-step; the others must stop with CollectiveFailed, not hang.
"""
import dataclasses
import os
import random
from collections import Counter
from datetime import timedelta

import pytest
import torch

from dcp_megatron.planner.costmodel import CostModel, ModelShape, cpu_cluster
from dcp_megatron.planner.plan import Group, MicroBatch, StepPlan, Wave
from dcp_megatron.planner.policies import make_plan
from dcp_megatron.planner.validate import validate
from dcp_megatron.runtime.group_pool import GroupPool
from dcp_megatron.core.microbatches import MICROBATCH_KEY
from tests.support.dist_utils import run_distributed
from tests.support.reference.parity import ReferenceRun, parity_case, roomy_cost
from tests.support.reference.single_process import reference_train_step, seeded_tokens
from tests.support.reference.tiny_gpt import TinyGPT, TinyGPTConfig

GRAD_TOL = 1e-5
LOSS_TOL = 1e-5
LAYOUTS_PER_WORLD = 16
TRAIN_STEPS = 20
TRAIN_CONFIG = TinyGPTConfig(vocab_size=64, num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2,
                             ffn_hidden_size=48)
TRAIN_MAX_SEQ_LEN = 256


def _train_cost(world_size: int) -> CostModel:
    """CPU physics for TRAIN_CONFIG, with a memory budget small enough that long documents need CP > 1."""
    c = TRAIN_CONFIG
    shape = ModelShape(num_layers=c.num_layers, hidden_size=c.hidden_size, num_heads=c.num_heads,
                       num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, ffn_hidden_size=c.ffn_hidden_size,
                       vocab_size=c.vocab_size)
    roomy = CostModel(shape, cpu_cluster(world_size))
    per_token = roomy.bytes_per_local_token(roomy.recompute_options()[-1])
    budget = roomy.static_bytes + int(per_token * (TRAIN_MAX_SEQ_LEN // 2 + 8))  # a max-length document needs cp 2
    cluster = dataclasses.replace(cpu_cluster(world_size), mem_bytes_per_gpu=int(budget / 0.9) + 1)
    return CostModel(shape, cluster)


def _train_batch(step: int, world_size: int) -> list[tuple[int, int]]:
    """Long-tailed lengths: mostly short documents, a few up to TRAIN_MAX_SEQ_LEN."""
    rng = random.Random(1000 * world_size + step)
    lengths = [min(TRAIN_MAX_SEQ_LEN, max(1, int(rng.lognormvariate(3.0, 1.1)))) for _ in range(6 * world_size)]
    lengths[rng.randrange(len(lengths))] = rng.randint(TRAIN_MAX_SEQ_LEN // 2, TRAIN_MAX_SEQ_LEN)
    first_id = step * 100
    return [(first_id + i, n) for i, n in enumerate(lengths)]


def _counting_tokens(sample_id: int, length: int) -> torch.Tensor:
    """Learnable documents: count up by one (mod vocab) from a per-document start."""
    start = (sample_id * 7919) % TRAIN_CONFIG.vocab_size
    return (start + torch.arange(length)) % TRAIN_CONFIG.vocab_size


def _train(rank: int, world_size: int, pool: GroupPool) -> dict:
    cost = _train_cost(world_size)
    model, reference = TinyGPT(TRAIN_CONFIG, seed=5), TinyGPT(TRAIN_CONFIG, seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=3e-3)
    tokens_of = _counting_tokens
    batches = [_train_batch(step, world_size) for step in range(TRAIN_STEPS)]

    def plan_function(sequences, cost):
        plan = make_plan("dcp", sequences, cost, max_seq_len=TRAIN_MAX_SEQ_LEN)
        validate(plan, sequences, cost.cluster, cost)
        return plan

    run = ReferenceRun(model, pool, batches, tokens_of, plan_function=plan_function, cost=cost,
                       seq_length=TRAIN_MAX_SEQ_LEN)
    losses, ref_losses, cp_sizes, stats = [], [], Counter(), []
    for batch in batches:
        trace: list = []
        result = run.step(trace=trace)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ref_losses.append(reference_train_step(reference, batch, tokens_of))
        ref_optimizer.step()
        ref_optimizer.zero_grad(set_to_none=True)
        losses.append(result.loss)
        cp_sizes.update(t[1] for t in trace)
        stats.append(result.stats)
    run.close()
    return {"losses": losses, "ref_losses": ref_losses, "cp_sizes": dict(cp_sizes),
            "stats_ranks": [len(s.ranks) for s in stats], "summary": stats[-1].summary()}


def _parity_worker(rank: int, world_size: int, num_layouts: int) -> dict:
    pool = GroupPool([list(range(world_size))], timeout=timedelta(seconds=60))
    cases = [parity_case(pool, 1000 * world_size + i, impl=("allgather", "ring")[i % 2])
             for i in range(num_layouts)]
    return {"cases": cases, "train": _train(rank, world_size, pool),
            "created": sorted(pool.created_blocks)}


# world 4 (CP-4 and 2 x CP-2 groups) in `make test-slow`; world 3 (CP-3 groups beside CP-1) in `make test`
@pytest.fixture(scope="module", params=[pytest.param(4, marks=pytest.mark.slow), 3], ids=["world4", "world3"])
def parity_results(request):
    return request.param, run_distributed(_parity_worker, request.param, LAYOUTS_PER_WORLD, timeout_s=900)


def test_gradients_and_loss_match_the_single_process_reference(parity_results):
    world_size, results = parity_results
    for rank, out in enumerate(results):
        for i, case in enumerate(out["cases"]):
            assert case["max_rel_err"] <= GRAD_TOL, (rank, i, case["max_rel_err"], case["plan"])
            assert case["loss"] == pytest.approx(case["ref_loss"], rel=1e-6, abs=1e-6), (rank, i, case["plan"])


def test_layouts_covered_what_the_proof_claims(parity_results):
    """The random layouts really exercised mixed CP sizes, uneven micro-batch counts and recompute."""
    world_size, results = parity_results
    plans = [StepPlan.from_json(c["plan"]) for c in results[0]["cases"]]
    mixed_wave = any(len({g.size for g in w.groups}) > 1 for p in plans for w in p.waves)
    uneven = any(len({len(g.microbatches) for g in w.groups}) > 1 for p in plans for w in p.waves)
    assert mixed_wave and uneven
    assert any(g.size == world_size for p in plans for w in p.waves for g in w.groups)
    # What each rank actually ran (sizes and recompute seen by the model) is what the plan said.
    kinds = Counter()
    for rank, out in enumerate(results):
        for case, plan in zip(out["cases"], plans):
            expected = [(w, g.size, rank - g.first_rank, str(mb.recompute))
                        for w, g in plan.rank_schedule(rank) for mb in g.microbatches]
            expected = [(*e, i == len(expected) - 1) for i, e in enumerate(expected)]  # only the last is last
            assert [tuple(t) for t in case["trace"]] == expected
            kinds.update(t[3][:4] for t in case["trace"])
    assert {"none", "sele", "full", "mlp", "core"} <= set(kinds)   # core: core_attn+mlp


def test_training_with_the_dcp_policy_matches_single_process_training(parity_results):
    world_size, results = parity_results
    for out in results:
        train = out["train"]
        assert len(train["losses"]) == TRAIN_STEPS
        diffs = [abs(a - b) for a, b in zip(train["losses"], train["ref_losses"])]
        assert max(diffs) <= LOSS_TOL, diffs
        assert train["ref_losses"][-1] < 0.9 * train["ref_losses"][0]    # it trained
        assert train["stats_ranks"] == [world_size] * TRAIN_STEPS  # every rank's timings gathered
    # The dcp plans used more than one CP size over the run (the dynamic path ran).
    cp_sizes = Counter()
    for out in results:
        cp_sizes.update({int(k): v for k, v in out["train"]["cp_sizes"].items()})
    assert len(cp_sizes) > 1, cp_sizes


# ---- a rank that dies mid-step --------------------------------------------------------------------
DYING_RANK = 2


def _dying_worker(rank: int, world_size: int) -> None:
    pool = GroupPool([list(range(world_size))], timeout=timedelta(seconds=3))

    def plan_function(sequences, cost):
        mb = lambda *ids: MicroBatch(tuple(sequences[i] for i in ids))  # noqa: E731
        return StepPlan(domain_size=3, waves=(
            Wave((Group(0, 2, (mb(0), mb(1))), Group(2, 1, (mb(2),)))),
            Wave((Group(0, 1, (mb(3),)), Group(1, 2, (mb(4),)))),
        ))

    def die_in_wave_0_of_step_2(batch):
        if rank == DYING_RANK and run.iteration == 2 and batch[MICROBATCH_KEY].wave_index == 0:
            os._exit(17)  # dies after wave 0 was handed out, before wave 1's group assembles

    tokens_of = seeded_tokens(TRAIN_CONFIG.vocab_size, seed=3)
    batch = [(i, 9 + i) for i in range(5)]
    run = ReferenceRun(TinyGPT(TRAIN_CONFIG), pool, [batch, batch], tokens_of, plan_function=plan_function,
                       cost=roomy_cost(TRAIN_CONFIG, world_size), seq_length=16,
                       before_microbatch=die_in_wave_0_of_step_2)
    run.step()   # a healthy step first
    run.step()


def test_a_dead_rank_stops_the_others_with_a_clear_error():
    with pytest.raises(RuntimeError) as info:
        run_distributed(_dying_worker, 3, timeout_s=120)
    message = str(info.value)
    assert f"rank {DYING_RANK} exited with code 17" in message
    sections = message.split("--- rank ")
    by_rank = {int(s.split(" ", 1)[0]): s for s in sections[1:]}
    assert set(by_rank) == {0, 1, 2}   # both survivors reported an error instead of hanging
    # rank 1 waits for rank 2 to join their wave-1 group; rank 0 waits in the gradient reduction.
    assert "CollectiveFailed" in by_rank[1] and "wave 1 group of domain ranks [1, 3)" in by_rank[1]
    assert "CollectiveFailed" in by_rank[0] and "over the DCP domain failed" in by_rank[0]
