"""`--dcp` with DeepSeek-V3-style layers inside megatron.training (tests/support/megatron_runs.DEEPSEEK_FLAGS: MLA
with a value head dim unlike the query's, a dense first layer, then MoE with sigmoid scores, the expert bias,
group-limited top-k, top-k scaling and a shared expert, and one multi-token-prediction layer; CPU, gloo, fp32).

Against megatron-core itself (`make test`): 2 ranks under `--dcp` against one rank of megatron-core and
megatron.training without --dcp and without dcp-megatron's patches (our script with only the CPU shims applied:
tests/support/megatron_runs.cpu_shims_only_script; they include our core attention for the local spec, since
megatron-core's own takes neither packed input nor MLA's head dims), the loss and MTP / balancing loss traces, every
parameter's gradient at every step and the expert biases after the last update. Without --dataloader-inter-document-masking a
document is one of Megatron's samples, so the objective (per-sequence balancing loss, MTP's shift) is Megatron's own
at --micro-batch-size 1; the budget makes every sample a CP-2 micro-batch with one layer recomputed (MLA's THD path
over a CP group, against Megatron's unpacked one).

Slow: 2-rank domains at EP 1 and EP 2 (plans mixing CP 1 and CP 2) against one rank training the same global batch with
`--dcp` (CP 1, its own packing), all from one set of initial weights (a 1-rank checkpoint): the loss and balancing
loss traces, every parameter's gradient at every step (experts by global index), and the expert bias after every
step's update (megatron-core's counts, summed over all of a step's micro-batches on each rank and all-reduced over
the domain; on this tiny model the same group of experts is overloaded at every step, so the bias's signs alone
would not tell one micro-batch's counts from the step's: tests/integration/test_megatron_moe_dispatchers.py checks
the counts themselves).
"""
from __future__ import annotations

import pytest
import torch

from tests.integration.test_megatron_moe import _assert_same_gradients
from tests.support.megatron_runs import (DEEPSEEK_FLAGS, DEEPSEEK_TINY, OUR_SCRIPT, LazyRuns, cpu_shims_only_script,
                                         is_own_plan, read_plan_dumps, run_training)

pytestmark = pytest.mark.timeout(1500)

ITERS = 3
TOLERANCE = 1e-5
# with DeepSeek-V3's one MTP layer (built like the last, MoE, layer; its loss weight 0.1)
EP1 = [*DEEPSEEK_FLAGS, "--moe-token-dispatcher-type", "alltoall", "--mtp-num-layers", "1",
       "--mtp-loss-scaling-factor", "0.1"]
EP2 = [*EP1, "--expert-model-parallel-size", "2"]
BUDGET = ["--dcp-memory-budget-gb", "0.015"]   # real bytes (costmodel/memory_spec.py CPU_FP32): EP 2 needs 0.013 to fit a --seq-length document
# The case against megatron-core: whole samples as documents, 4 per step (2 per rank)
SAMPLES = [*(flag for flag in DEEPSEEK_TINY if flag != "--dataloader-inter-document-masking"),
           "--global-batch-size", "4"]
# every 1,024-token sample a CP-2 micro-batch with full recompute of one layer (real bytes, CPU_FP32)
SAMPLES_BUDGET = ["--dcp-memory-budget-gb", "0.012"]


def _saves(root, name) -> list[str]:
    return ["--save", str(root / name), "--save-interval", "1", "--save-wgrads-interval", "1", "--no-save-optim",
            "--no-save-rng"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    runs = LazyRuns(tmp_path_factory.mktemp("megatron_deepseek"))
    root, after = runs.root, runs.after
    from_init = ["--load", str(root / "init"), "--finetune", "--no-load-optim", "--no-load-rng"]
    runs.specs = specs = {
        "init": lambda: run_training(OUR_SCRIPT, [*EP1, "--lr", "0", "--min-lr", "0", "--lr-warmup-iters", "0",
                                                  "--save", str(root / "init"), "--save-interval", "1"],
                                     nproc=1, launcher=False, iters=1, base=DEEPSEEK_TINY),
        "one_rank": lambda: after("init", lambda: run_training(
            OUR_SCRIPT, [*EP1, *from_init, *_saves(root, "one_rank"), "--dcp"], nproc=1, iters=ITERS,
            base=DEEPSEEK_TINY)),
    }
    upstream = str(root / "upstream_pretrain_gpt.py")
    cpu_shims_only_script(OUR_SCRIPT, upstream)
    wgrads = ["--save-interval", "1000", "--save-wgrads-interval", "1", "--no-save-optim", "--no-save-rng"]
    specs.update({
        "upstream": lambda: run_training(upstream, [*EP1, "--save", str(root / "upstream"), *wgrads], nproc=1,
                                         launcher=False, iters=ITERS, base=SAMPLES),
        "samples_dcp": lambda: run_training(
            OUR_SCRIPT, [*EP1, "--save", str(root / "samples_dcp"), *wgrads, "--dcp", *SAMPLES_BUDGET,
                         "--dcp-dump-plans", str(root / "samples_dcp_plans")], nproc=2, iters=ITERS, base=SAMPLES),
    })
    for name, layout in (("ep1", EP1), ("ep2", EP2)):
        specs[name] = (lambda name=name, layout=layout: after("init", lambda: run_training(
            OUR_SCRIPT, [*layout, *from_init, *_saves(root, name), "--dcp", *BUDGET, "--dcp-dump-plans",
                         str(root / f"{name}_plans"), "--dcp-check-plans"], nproc=2, iters=ITERS,
            base=DEEPSEEK_TINY)))
    return runs


def expert_biases(directory, step: int) -> dict[str, torch.Tensor]:
    """Every router's expert bias in a torch_dist checkpoint of a step (converted to one torch file first)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    converted = directory / f"expert_bias_{step}.pt"
    dcp_to_torch_save(str(directory / f"iter_{step:07d}"), str(converted))
    state = torch.load(converted, map_location="cpu", weights_only=False)
    biases = {key: value for key, value in state.items() if key.endswith("router.expert_bias")}
    assert biases, sorted(state)[:20]
    return biases


def test_deepseek_layers_under_dcp_train_megatron_cores_own_steps(runs):
    """MLA + MoE (sigmoid, expert bias, group top-k, shared expert) + MTP under --dcp on 2 ranks against one rank of
    megatron-core without --dcp and without our patches: losses, gradients and the expert biases."""
    dcp, upstream = runs("samples_dcp"), runs("upstream")
    # the reference's parser had no --dcp flags (Megatron prints every argument; the patched parser adds dcp_*)
    assert not upstream.dcp_steps and "dcp_memory_budget_gb" not in upstream.output
    assert "dcp_memory_budget_gb" in dcp.output
    assert sorted(dcp.losses) == sorted(upstream.losses) == list(range(1, ITERS + 1))
    for step, loss in upstream.losses.items():
        assert dcp.losses[step] == pytest.approx(loss, rel=TOLERANCE), ("lm loss", step)
        for metric in ("seq_load_balancing_loss", "mtp_1 loss"):
            logged = upstream.moe_metrics[metric][step]
            assert dcp.moe_metrics[metric][step] == pytest.approx(logged, rel=TOLERANCE), (metric, step)
    _assert_same_gradients(runs.root, "samples_dcp", "upstream", steps=list(range(1, ITERS + 1)))
    got, expected = expert_biases(runs.root / "samples_dcp", ITERS), expert_biases(runs.root / "upstream", ITERS)
    assert got.keys() == expected.keys() and all(torch.equal(got[key], expected[key]) for key in got), (got, expected)
    # what dcp ran: its own plans, every sample a CP-2 micro-batch with one layer recomputed
    plans = read_plan_dumps(runs.root / "samples_dcp_plans", count=ITERS)
    assert all(is_own_plan(plan) for plan in plans), [plan.extra for plan in plans]
    kinds = {(g.size, str(mb.recompute)) for plan in plans for wave in plan.waves for g in wave.groups
             for mb in g.microbatches if mb.sequences}
    assert kinds == {(2, "full1")}, kinds


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ep1", "ep2"])
def test_deepseek_layers_under_dcp_train_one_ranks_step_and_expert_bias(runs, layout):
    dcp, one_rank = runs(layout), runs("one_rank")
    assert sorted(dcp.losses) == sorted(one_rank.losses) == list(range(1, ITERS + 1))
    for step, loss in one_rank.losses.items():
        assert dcp.losses[step] == pytest.approx(loss, rel=TOLERANCE), ("lm loss", step)
        for metric in ("seq_load_balancing_loss", "mtp_1 loss"):
            logged = one_rank.moe_metrics[metric][step]
            assert dcp.moe_metrics[metric][step] == pytest.approx(logged, rel=TOLERANCE), (metric, step)
    _assert_same_gradients(runs.root, layout, "one_rank", steps=list(range(1, ITERS + 1)))
    biases = []
    for step in range(1, ITERS + 1):
        got, expected = expert_biases(runs.root / layout, step), expert_biases(runs.root / "one_rank", step)
        assert got.keys() == expected.keys()
        for key in got:
            assert torch.equal(got[key], expected[key]), (layout, step, key, got[key], expected[key])
        biases.append(torch.cat([got[key] for key in sorted(got)]))
    # the bias moved at every step (by +-rate per expert: no expert ever had exactly the mean count)
    assert all(not torch.equal(before, after) for before, after in zip(biases, biases[1:])), biases
    plans = read_plan_dumps(runs.root / f"{layout}_plans", count=ITERS)
    assert any({g.size for wave in plan.waves for g in wave.groups} == {1, 2} for plan in plans), \
        [plan.extra for plan in plans]
