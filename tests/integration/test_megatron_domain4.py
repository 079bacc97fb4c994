"""`--dcp` in megatron.training's loop on a DP x CP domain of 4 ranks (TP 1, CPU, gloo, fp32), in one launch.

What a domain of 2 cannot show: plans with two CP-2 groups side by side, a CP-4 group, a CP-3 group (not a
power of two) and a rank idle in a wave, each rank's micro-batches handed exactly the group its plan names
(recorded at the decoder's input, `microbatch_trace.py`). The run also carries two round-three bugs:
Megatron's default learned absolute position embeddings with 1,024-token documents on CP-3 groups (padding
to a multiple of 6 ran past the 1,024-row table: IndexError), and a batch-size schedule (8 samples for three
steps, then 16) with the default planning ahead (the step where the batch grows trained the old size).
Everything is compared with one rank running Megatron's plain path on the same schedule: loss trace, grad
norms, and every parameter's gradient (main_grad, saved before clipping) at every step.

Real plans from real lengths: Megatron's mock documents (most samples one 1,024-token piece) with 3 MiB per
rank and no recompute allowed make a 1,024-token document need CP 3 or 4 alone and two of them fit CP 2
each. Two launches (~1-3 min on 2 cores): marked slow.
"""
from __future__ import annotations

import glob
import pytest
import torch

from tests.support.megatron_runs import (LLAMA_TINY, OUR_SCRIPT, flatten_state, is_own_plan, microbatches_planned,
                                         microbatches_seen, read_plan_dumps, run_training)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

ITERS = 6
TOLERANCE = 1e-5
SEQ = 1024
# tokens:samples; 24,576 tokens = 24 samples: steps 1-3 train 8 samples, steps 4-6 train 16.
SCHEDULE = ["--step-batch-size-schedule", "0:8 24576:16"]
SAMPLES = {step: 8 if step <= 3 else 16 for step in range(1, ITERS + 1)}
# No --position-embedding-type: Megatron's default, learned absolute (a table of --max-position-embeddings rows).
BASE = [f for f in LLAMA_TINY if f not in ("--position-embedding-type", "rope")]
BASE = [f for i, f in enumerate(BASE) if f != "--global-batch-size" and BASE[i - 1] != "--global-batch-size"]
# Without --global-batch-size Megatron sets it to micro-batch x data-parallel size (1 on one rank, 4 here), and in
# iteration-based training its LR warm-up and decay are counted in samples of that size: a constant LR keeps the
# one-rank reference on the same learning rates.
BASE += ["--lr-decay-style", "constant", "--lr-warmup-iters", "0"]
assert "rope" not in BASE and "--global-batch-size" not in BASE


def _wgrads(root, name):
    return ["--save", str(root / name), "--save-interval", "1000", "--save-wgrads-interval", "1",
            "--no-save-optim", "--no-save-rng"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("domain4")
    reference = run_training(OUR_SCRIPT, [*SCHEDULE, *_wgrads(root, "reference")], nproc=1, launcher=False,
                             iters=ITERS, base=BASE, timeout_s=1200).check()
    dcp = run_training(OUR_SCRIPT, [*SCHEDULE, *_wgrads(root, "dcp"), "--dcp", "--dcp-memory-budget-gb", "0.0055",
                                    "--dcp-recompute", "none", "--dcp-no-refine", "--dcp-dump-plans",
                                    str(root / "plans")],
                       nproc=4, launcher=False, iters=ITERS, base=BASE, timeout_s=1200)
    for name, run in (("reference", reference), ("dcp", dcp)):
        (root / f"{name}.log").write_text(run.output)   # for a failure's post-mortem
    return root, reference, dcp.check()


def test_loss_trace_and_grad_norms_equal_one_rank_on_the_same_batch_schedule(runs):
    _, reference, dcp = runs
    assert sorted(dcp.losses) == sorted(reference.losses) == list(range(1, ITERS + 1))
    for step in reference.losses:
        assert dcp.losses[step] == pytest.approx(reference.losses[step], rel=TOLERANCE), ("loss", step)
        # printed with 3 decimals: equal to the print's precision (the gradients below are checked exactly)
        assert dcp.grad_norms[step] == pytest.approx(reference.grad_norms[step], abs=1.5e-3), ("grad norm", step)


def _grads(root, name, step):
    (path,) = glob.glob(str(root / name / "wgrads" / f"iter_{step:07d}" / "*"))
    return flatten_state(torch.load(path, map_location="cpu", weights_only=False))


def test_gradients_equal_one_device_at_every_step_including_where_the_batch_grows(runs):
    """Step 1 from identical weights: within TOLERANCE (measured 3e-7). Later steps start from weights that already
    differ by float rounding after Adam steps (measured 1-2e-5, not growing); a step trained on other samples, or
    a 1/8-vs-1/9 scale, is off by far more than the 1e-4 they are held to."""
    root, _, _ = runs
    for step in range(1, ITERS + 1):
        tolerance = TOLERANCE if step == 1 else 1e-4
        reference, dcp = _grads(root, "reference", step), _grads(root, "dcp", step)
        assert reference.keys() == dcp.keys() and reference
        worst = max(float((dcp[k] - reference[k]).abs().max() / reference[k].abs().max().clamp(min=1e-30))
                    for k in reference)
        print(f"step {step}: gradients vs the 1-device reference, max relative error {worst:.2e}")
        assert worst <= tolerance, f"step {step}: gradients differ from one device by {worst:.2e}"


def test_each_step_planned_the_samples_megatron_trained(runs):
    """Planned one step ahead, the step where the schedule grows the batch plans all its 16 samples."""
    root, _, dcp = runs
    plans = read_plan_dumps(root / "plans")
    assert len(plans) == ITERS
    assert [sum(n for _, n in plan.sequences()) for plan in plans] == [SAMPLES[s] * SEQ for s in range(1, ITERS + 1)]
    assert "ahead" in dcp.output   # the default: planned during the previous step


def test_plans_hold_side_by_side_cp2_a_cp4_a_cp3_group_and_an_idle_rank(runs):
    root, _, dcp = runs
    plans = read_plan_dumps(root / "plans")
    assert all(plan.domain_size == 4 and plan.policy == "dcp" for plan in plans)
    assert all(s["policy"].startswith("dcp") for s in dcp.dcp_steps.values()) and len(dcp.dcp_steps) == ITERS
    # a step where a baseline's layout is faster by the model runs it, labelled a fallback; the shapes below are
    # dcp's own layouts
    own = [plan for plan in plans if is_own_plan(plan)]
    assert len(own) >= ITERS - 2, [p.extra for p in plans]   # most steps (5 of 6 measured)
    waves = [[g for g in wave.groups if g.microbatches] for plan in own for wave in plan.waves]
    assert any(sorted(g.size for g in busy) == [2, 2] for busy in waves), "no wave ran two CP-2 groups side by side"
    assert any(g.size == 4 for busy in waves for g in busy), "no CP-4 group"
    assert any(g.size == 3 for busy in waves for g in busy), "no CP-3 group"
    assert any(sum(g.size for g in busy) < 4 for busy in waves), "no rank idle in a wave"


def test_every_microbatch_ran_on_the_group_and_recompute_its_plan_named(runs):
    """Per rank and micro-batch, the CP group the decoder was handed (global ranks; TP 1: domain = world) and
    the recompute set on the model, against the dumped plan's schedule for that rank."""
    root, _, _ = runs
    plans = read_plan_dumps(root / "plans")
    for rank in range(4):
        for step, plan in enumerate(plans, start=1):
            seen = microbatches_seen(root / "plans", rank, step)
            assert seen == microbatches_planned(plan, rank), (rank, step)
