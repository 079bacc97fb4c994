"""`--dcp` with tensor, pipeline and expert parallelism inside megatron.training (<= 4 CPU ranks, gloo, fp32).

With TP 2 or PP 2 on 4 ranks the DCP domain is Megatron's data-parallel group of 2 ranks at each
TP/PP coordinate. Megatron's initial weights depend on the TP/PP layout (its RNG is consumed per
partition), so each `--dcp` run is compared with Megatron's own plain path at the same TP/PP on
2 ranks (data-parallel size 1: one micro-batch of one sample at a time, the whole global batch on
one model replica). That plain path was checked against a 1-rank run on the same weights: a TP-2
checkpoint loaded by one rank gives the same losses to 7 digits (docs/megatron.md).

- TP 2 + sequence parallelism: every TP rank builds its own micro-batches from the same plan
  (nothing is broadcast per micro-batch), documents are padded so rows split evenly over TP, the
  plans mix CP 1 and 2, no recompute and full recompute and unequal micro-batch counts (in the steps planned
  before measured times refine the cost model: fixed by the lengths and the count).
- PP 2: Megatron's 1F1B schedule with per-micro-batch shapes; the plan gives every rank one
  micro-batch per wave (equal counts), mixing CP 1 and 2, and MLP recompute beside full recompute of the
  stage's layers in every step of dcp's own. The model is GPT-2-style (a GELU MLP with linear biases,
  megatron's defaults), whose MLP recompute once recursed until the rank died.
- What ran: every micro-batch on every rank (TP 2 + SP, PP 2, PP 2 x VPP 2) replayed in backward the recompute
  its plan named and ran on its plan's CP group (the trace --dcp-dump-plans writes, counted inside the replays).
- MoE: tests/integration/test_megatron_moe.py.
- Virtual pipeline stages: PP 2 x VPP 2 (a 2-rank domain, mixed CP) and PP 4 x VPP 2 (slow; 8 ranks, a 2-rank
  domain at every stage, mixed CP and recompute).
- Megatron's own static `--context-parallel-size 2` (2 ranks) against one rank, both starting from
  the same weights (a 1-rank checkpoint loaded with `--finetune`: CP, too, changes Megatron's
  initial weights). Megatron shards each sample over its CP group, so these runs train whole
  samples as sequences (no `--dataloader-inter-document-masking`, see core_attention.py).
"""
from __future__ import annotations

import pytest

from dcp_megatron.planner.plan import StepPlan
from tests.support.megatron_runs import (LLAMA_TINY, OUR_SCRIPT, LazyRuns, is_own_plan, microbatches_planned,
                                         microbatches_seen, read_plan_dumps, run_training)

pytestmark = pytest.mark.timeout(1500)

ITERS = 6   # refinement starts at step 4: three refined steps; one evaluation (step 5) besides the last
# PP 2 plans without refinement (it needs PP 1): every step's plan follows from its lengths and the budget, so steps
# 5-6 would only repeat what steps 1-4 check; an evaluation after step 3, then step 4 trains on, besides the last.
# (TP keeps 6: a cost model refined differently on TP peers once surfaced only at step 6, --dcp-check-plans.)
PP_ITERS = 4
PP_EVAL = ["--eval-interval", "3"]   # LLAMA_TINY's 5 would leave only the last
TOLERANCE = 1e-5
TP_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
PP = ["--pipeline-model-parallel-size", "2", "--num-layers", "4"]
# megatron's default MLP (GELU, linear biases) on the PP runs: its output bias used to come back through the MLP's
# recompute checkpoint as the Parameter itself (patches/tensor_parallel_random.py)
GELU_WITH_BIASES = [flag for flag in LLAMA_TINY if flag not in ("--swiglu", "--disable-bias-linear")]
UNREFINED_STEPS = 3
# Budgets (real bytes: costmodel/memory_spec.py CPU_FP32) that make 1,024-token documents need CP 2 or recompute at
# this layout (TP halves the activations per rank; 1F1B keeps two micro-batches per stage in flight).
# The unrefined steps' plans follow from the lengths and this count alone (checked below, so the test does not depend
# on measured times): CP 1 beside CP 2, none beside full recompute of one layer, 8 and 9 micro-batches. Found offline
# by planning these steps' global batches (from the run's plan dumps) with the run's cost model over budgets
# 0.0030-0.0045 and the menus none,selective / selective,full / none,selective,full (also with recompute made up to
# 30x dearer by a profile): no budget makes the count choose core-attention recompute here (at CP 2 it frees too
# little to change what fits: a 1,024-token document fits CP 2 without recompute from 0.00366, and not with it at
# 0.003655), so core attention runs only where measured times choose it and is not asserted.
TP_BUDGET = ["--dcp-memory-budget-gb", "0.0037", "--dcp-recompute", "none,selective,full"]
# 2 layers per stage: at this budget some micro-batches fit with MLP recompute, fuller ones need a layer recomputed
# (counted as the CPU run keeps them, one layer's full recompute holds more than MLP recompute), 1,024-token
# documents need CP 2
PP_BUDGET = ["--dcp-memory-budget-gb", "0.0055", "--dcp-recompute", "mlp,full"]
# Virtual pipeline stages (interleaved 1F1B), 4 layers, one per virtual stage. PP 2 x VPP 2 on 4 ranks: a 2-rank
# domain, so plans mix CP 1 and 2 on every model chunk (1,024-token documents need CP 2 at this budget). PP 4 x
# VPP 2 (8 layers) on 8 ranks (~2.5 min on 2 cores): a 2-rank domain at each of the 4 stages, CP groups on two
# middle stages, the interleaved schedule's micro-batch groups (fillers up to a multiple of 4), and CP-2
# micro-batches with full recompute next to CP-1 ones that recompute differently on the two ranks (full recompute
# replays a CP micro-batch's forward after later forwards ran: it once hung there, patches/transformer_attention.py).
VPP = ["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1"]
# MLP recompute beside full k (under the CPU count core-attention recompute frees too little to be chosen)
VPP_BUDGET = ["--dcp-memory-budget-gb", "0.01", "--dcp-recompute", "mlp,full"]
PP4_VPP2 = ["--pipeline-model-parallel-size", "4", "--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "1"]
# full recompute only in the first steps (under the CPU count the light reliefs the menu offers are never chosen
# beside CP-2 full recompute with dcp's own plans; scanned offline 0.012-0.017 with mlp,full): the replay case
PP4_BUDGET = ["--dcp-memory-budget-gb", "0.021", "--dcp-recompute", "selective,full"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    runs = LazyRuns(tmp_path_factory.mktemp("megatron_mp"))
    root = runs.root
    runs.specs = specs = {
        "tp_plain": lambda: run_training(OUR_SCRIPT, TP_SP, nproc=2, iters=ITERS),
        "tp_dcp": lambda: run_training(OUR_SCRIPT, [*TP_SP, "--dcp", *TP_BUDGET, "--dcp-check-plans",
                                                    "--dcp-dump-plans", str(root / "tp_plans")],
                                       nproc=4, iters=ITERS),
        "pp_plain": lambda: run_training(OUR_SCRIPT, [*PP, *PP_EVAL], nproc=2, iters=PP_ITERS, base=GELU_WITH_BIASES),
        "pp_dcp": lambda: run_training(OUR_SCRIPT, [*PP, *PP_EVAL, "--dcp", *PP_BUDGET, "--dcp-check-plans",
                                                    "--dcp-dump-plans", str(root / "pp_plans")],
                                       nproc=4, iters=PP_ITERS, base=GELU_WITH_BIASES),
    }
    specs.update({
        "vpp_plain": lambda: run_training(OUR_SCRIPT, VPP, nproc=2, iters=ITERS),
        "vpp_dcp": lambda: run_training(OUR_SCRIPT, [*VPP, "--dcp", *VPP_BUDGET, "--dcp-check-plans",
                                                     "--dcp-dump-plans", str(root / "vpp_plans")], nproc=4, iters=ITERS),
        "pp4vpp2_plain": lambda: run_training(OUR_SCRIPT, PP4_VPP2, nproc=4, iters=ITERS),
        "pp4vpp2_dcp": lambda: run_training(OUR_SCRIPT, [*PP4_VPP2, "--dcp", *PP4_BUDGET, "--dcp-dump-plans",
                                                         str(root / "pp4vpp2_plans")], nproc=8, iters=ITERS,
                                            timeout_s=1200),
    })
    no_masking = [flag for flag in LLAMA_TINY if flag != "--dataloader-inter-document-masking"]
    from_init = ["--load", str(root / "init"), "--finetune", "--no-load-optim", "--no-load-rng"]
    specs.update({
        # The initial weights of a 1-rank run (lr 0: one step changes nothing but the optimizer's moments).
        "init": lambda: run_training(OUR_SCRIPT, ["--lr", "0", "--min-lr", "0", "--lr-warmup-iters", "0", "--save",
                                                  str(root / "init"), "--save-interval", "1"],
                                     nproc=1, launcher=False, iters=1, base=no_masking),
        "cp_reference": lambda: runs.after("init", lambda: run_training(
            OUR_SCRIPT, from_init, nproc=1, launcher=False, iters=ITERS, base=no_masking)),
        "cp_static": lambda: runs.after("init", lambda: run_training(
            OUR_SCRIPT, [*from_init, "--context-parallel-size", "2"], nproc=2, iters=ITERS, base=no_masking)),
    })
    return runs


def _plans(directory, iters: int = ITERS) -> list[StepPlan]:
    return read_plan_dumps(directory, count=iters)


def _assert_same_training(run, reference, what: str, iters: int = ITERS) -> None:
    """Loss trace within TOLERANCE (printed: pytest -s), grad norms equal."""
    trace, expected = run.loss_trace(), reference.loss_trace()
    assert len(trace) == len(expected) == iters
    worst = max(abs(a - b) / abs(b) for a, b in zip(trace, expected))
    print(f"\n{what}: max relative loss difference {worst:.2e} over {iters} steps")
    assert worst <= TOLERANCE, f"{what}: trace differs by {worst:.2e}\n{trace}\n{expected}"
    for step, norm in run.grad_norms.items():
        assert norm == pytest.approx(reference.grad_norms[step], rel=2e-3, abs=2e-3), (what, step)


@pytest.mark.parametrize("layout", ["tp", "pp"])
def test_dcp_loss_trace_and_grad_norms_equal_megatrons_plain_path_at_the_same_layout(runs, layout):
    dcp, plain = runs(f"{layout}_dcp"), runs(f"{layout}_plain")
    _assert_same_training(dcp, plain, f"{layout}: --dcp vs plain", PP_ITERS if layout == "pp" else ITERS)
    assert dcp.eval_losses.keys() == plain.eval_losses.keys() and dcp.eval_losses
    for step, loss in dcp.eval_losses.items():
        assert loss == pytest.approx(plain.eval_losses[step], rel=TOLERANCE), (layout, "validation", step)


def test_tp_dcp_path_ran_dcps_own_plans_with_mixed_cp_recompute_and_counts(runs):
    dcp = runs("tp_dcp")
    assert sorted(dcp.dcp_steps) == list(range(1, ITERS + 1))
    # every step planned by dcp; from step 4 refined times may make a baseline's layout win (labelled a fallback)
    assert all(step["policy"].startswith("dcp") for step in dcp.dcp_steps.values())
    assert all(is_own_plan(dcp.dcp_steps[i]["policy"]) for i in range(1, UNREFINED_STEPS + 1)), dcp.dcp_steps
    plans = _plans(runs.root / "tp_plans")
    assert all(plan.policy == "dcp" and plan.domain_size == 2 for plan in plans)
    assert all(is_own_plan(plan) for plan in plans[:UNREFINED_STEPS]), [plan.extra for plan in plans]
    # Refinement is on (the default): from step 4 plans depend on measured times. Steps 1-3 are planned
    # with the configured cost model (step 1's times are not used, and step 3 is planned while step 2
    # runs), so their shape is fixed by the lengths alone: check it there.
    first = plans[:UNREFINED_STEPS]
    assert {g.size for plan in first for wave in plan.waves for g in wave.groups} == {1, 2}
    kinds = {mb.recompute.kind for plan in first for wave in plan.waves for g in wave.groups
             for mb in g.microbatches if mb.sequences}
    # none beside full k in the steps the count alone plans (TP_BUDGET)
    assert {"none", "full"} <= kinds, kinds
    assert any(min(dcp.dcp_steps[i]["counts"]) != max(dcp.dcp_steps[i]["counts"])
               for i in range(1, UNREFINED_STEPS + 1))
    # The cost model was refined from measured times (the default), identically on all 4 ranks: every plan's
    # hash matched over the world (--dcp-check-plans), TP peers included.
    assert "measured corrections cp" in dcp.output


def test_pp_dcp_path_ran_one_microbatch_per_group_per_wave_with_mixed_cp(runs):
    dcp = runs("pp_dcp")
    assert sorted(dcp.dcp_steps) == list(range(1, PP_ITERS + 1))
    # Every step planned by dcp. In lockstep on two ranks a baseline's layout is sometimes faster by the model:
    # dcp then runs it (labelled), through the same PP path. Most steps are dcp's own layout, and the shapes
    # are checked on those.
    assert all(step["policy"].startswith("dcp") for step in dcp.dcp_steps.values())
    plans = _plans(runs.root / "pp_plans", PP_ITERS)
    own = [plan for plan in plans if is_own_plan(plan)]
    assert len(own) >= PP_ITERS - 2, [plan.extra for plan in plans]
    for plan in plans:
        assert plan.policy == "dcp" and plan.domain_size == 2
        assert all(len(g.microbatches) == 1 for wave in plan.waves for g in wave.groups)
    assert all(min(step["counts"]) == max(step["counts"]) for step in dcp.dcp_steps.values())
    for plan in own:   # CP 1 beside CP 2, MLP recompute beside full recompute of a stage layer, in one step
        assert {g.size for wave in plan.waves for g in wave.groups} == {1, 2}, plan.summary()
        reliefs = {str(mb.recompute) for wave in plan.waves for g in wave.groups for mb in g.microbatches
                   if mb.sequences}
        assert reliefs == {"mlp", "full1"}, reliefs
    assert "measured corrections" not in dcp.output   # refinement needs PP 1 (1F1B interleaves micro-batches)


def _assert_every_microbatch_ran_as_planned(directory, plans, *, coordinates, to_global, name=str, chunks=(None,)):
    """Each traced rank's micro-batches, step by step (and model chunk by chunk): the recompute their backward
    replayed and their CP group (global ranks) are the plan's. `coordinates`: the TP/PP coordinates of the ranks
    traced; `to_global(domain_rank, coordinate)`: a domain rank's global rank there."""
    ran = set()
    for step, plan in enumerate(plans, start=1):
        for coordinate in coordinates:
            for rank in range(plan.domain_size):
                for chunk in chunks:
                    seen = microbatches_seen(directory, to_global(rank, coordinate), step, chunk=chunk)
                    expected = microbatches_planned(plan, rank, to_global=lambda r: to_global(r, coordinate),
                                                    name=name)
                    assert seen == expected, (step, coordinate, rank, chunk, seen, expected)
                    ran |= {recompute for _, recompute in seen}
    return ran


def test_every_microbatch_replayed_its_plans_recompute_under_tp_and_pp(runs):
    """TP 2 + SP (global rank = tp + 2 x domain rank) and PP 2 (global rank = domain rank + 2 x stage): what each
    micro-batch's backward replayed, counted inside the replays, and its CP group."""
    runs("tp_dcp")
    ran = _assert_every_microbatch_ran_as_planned(runs.root / "tp_plans", _plans(runs.root / "tp_plans"),
                                                  coordinates=(0, 1), to_global=lambda r, tp: tp + 2 * r)
    # none and full k run in the unrefined steps (TP_BUDGET); what later, refined, steps choose is checked as it ran
    assert "none" in ran and any(kind.startswith("full") for kind in ran), ran
    runs("pp_dcp")
    ran = _assert_every_microbatch_ran_as_planned(runs.root / "pp_plans", _plans(runs.root / "pp_plans", PP_ITERS),
                                                  coordinates=(0, 1), to_global=lambda r, stage: r + 2 * stage)
    assert {"mlp", "full1"} <= ran, ran


@pytest.mark.slow   # upstream's own CP 2 against one rank: the premise the --dcp comparisons rest on
def test_megatrons_static_cp2_trains_the_one_rank_trace_from_the_same_weights(runs):
    static, reference = runs("cp_static"), runs("cp_reference")
    assert "successfully loaded checkpoint" in static.output and not static.dcp_steps
    _assert_same_training(static, reference, "Megatron --context-parallel-size 2 vs 1 rank")


# both in `make test-slow` (the suite's time): PP 2 x VPP 2 on 4 ranks, PP 4 x VPP 2 on 8
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["vpp", "pp4vpp2"])
def test_virtual_pipeline_stages_dcp_equals_megatrons_plain_path(runs, layout):
    dcp, plain = runs(f"{layout}_dcp"), runs(f"{layout}_plain")
    _assert_same_training(dcp, plain, f"{layout}: --dcp vs plain")
    plans = _plans(runs.root / f"{layout}_plans")
    assert all(is_own_plan(plan) for plan in plans), [plan.extra for plan in plans]
    assert all(len(g.microbatches) == 1 for plan in plans for wave in plan.waves for g in wave.groups)
    sizes = {g.size for plan in plans for wave in plan.waves for g in wave.groups}
    assert sizes == {1, 2}, sizes
    # what each chunk replayed: full k of the stage's 2 layers is ceil(k / 2) of each chunk's one layer
    # (core/recompute.apply_recompute); global rank = domain rank + 2 x stage
    per_chunk = lambda rc: f"full{-(-rc.full_layers // 2)}" if rc.kind == "full" else str(rc)  # noqa: E731
    ran = _assert_every_microbatch_ran_as_planned(runs.root / f"{layout}_plans", plans,
                                                  coordinates=range(2 if layout == "vpp" else 4),
                                                  to_global=lambda r, stage: r + 2 * stage, name=per_chunk,
                                                  chunks=(0, 1))
    assert "full1" in ran and ("mlp" in ran or layout == "pp4vpp2"), ran
    if layout == "pp4vpp2":   # the replay case: CP-2 full recompute beside CP-1 micro-batches
        kinds = {(g.size, mb.recompute.kind) for plan in plans for wave in plan.waves for g in wave.groups
                 for mb in g.microbatches if mb.sequences}
        assert {(2, "full"), (1, "full")} <= kinds, kinds