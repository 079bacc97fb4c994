"""DCP inside the DeepSpeed engine: gradients, loss traces, the dynamic path, resume and refusals.

- gradient parity (one 2-rank launch, many cases): after each of two steps, the update a DeepSpeed
  engine applied (SGD, so update = lr x gradient) equals lr x the gradient of one device on the
  whole global batch, for ZeRO 0 and 2 with planned steps (mixed CP sizes, unequal micro-batch
  counts), for ZeRO 2 with Ulysses CP attention and for ZeRO-3 (lockstep plans, dcp's own; all-gather
  with full recompute shared by whole waves, as the dumped plans and the trace of what ran show, and Ulysses
  with MLP recompute waves), and on Megatron's blended GPT datasets (two .bin/.idx
  corpora, `--data-path 0.7 A 0.3 B --split 90,5,5`) with and without `--dcp` (the same losses, and one
  device's); every process group (DeepSpeed's own included) has the run's --distributed-timeout-minutes;
  a ZeRO step whose block raised does not flush its reduction;
- the real script (pretrain_scripts/pretrain_gpt_deepspeed.py, torchrun, 6 steps, Megatron's flags:
  --global-batch-size, --micro-batch-size, --tokenizer-type, --split, --mock-data; no CPU flags, which it
  defaults and names in one line): `--dcp` under ZeRO-1 and ZeRO-3 (with Ulysses CP attention), the static
  layout and a 1-rank run give the same loss trace and grad norms; the plans dumped
  by `--dcp-dump-plans` mix CP sizes and give ranks different micro-batch counts, and every micro-batch ran
  the CP group and the recompute its plan named (the trace beside the plans); ZeRO-3's plans are lockstep;
  a resume from DeepSpeed's checkpoint (ZeRO-1 and ZeRO-3) continues the trace (the ZeRO-1 run stops at step 3 by
  --exit-interval, which saves, and its resumed run is the rest of its trace); every run trains on Megatron's
  schedule flags (`--lr-decay-style cosine --lr-warmup-iters 2 --min-lr`, no JSON scheduler) and logs the
  learning rate Megatron's loop logs, the resumed ones too (the scheduler's step count resumes); evaluation (Megatron's
  --eval-interval / --eval-iters) gives every layout one device's validation loss, also after a resume. (Bad settings and faults: tests/integration/test_fault_matrix.py.)
"""
from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from tests.support.deepspeed_runs import TINY_MODEL, blend_flags, ds_config, load_ds_script, run_deepspeed, write_blend
from tests.support.dist_utils import group_timeout_s, group_timeouts_s, max_rel_err, run_distributed
from tests.support.megatron_runs import (is_own_plan, microbatches_planned, microbatches_seen, parse_output,
                                         read_plan_dumps)

# real bytes (planner/costmodel/memory_spec.py CPU_FP32): tight enough that long documents need CP 2 or recompute
BUDGET = ["--dcp-memory-budget-gb", "0.00625"]
# ZeRO-3 (weights gathered per layer): the longest documents need CP 2, shorter ones run alone, some waves MLP recompute
Z3_BUDGET = ["--dcp-memory-budget-gb", "0.008"]
# ZeRO-3 with full recompute shared by whole waves: tighter, none or full only (full1 waves, CP 1 and 2)
Z3_RELIEF = ["--dcp-memory-budget-gb", "0.0055", "--dcp-recompute", "none,full"]
# megatron's default MLP (GELU, linear biases) with MLP recompute under ZeRO-1: the MLP's output bias comes back
# through its recompute checkpoint, which once made the bias Parameter a checkpoint output whose backward replayed
# itself until the rank died (~10 GB; patches/tensor_parallel_random.py, in patches/deepspeed_set.py's set)
GELU_WITH_BIASES = [flag for flag in TINY_MODEL if flag not in ("--swiglu", "--disable-bias-linear")]
GELU_RELIEF = ["--dcp-memory-budget-gb", "0.00625", "--dcp-recompute", "none,mlp"]
# The parity launch's bound per rank (a rank uses ~1 GiB): a runaway replay fails the test there, not the machine
PARITY_MAX_RSS_BYTES = 3 * 2**30
ITERS = 6      # the trace runs' steps; refinement may change plans from step 4 (steps 1-3: lengths alone)
HALF = 3       # the resumed run loads the checkpoint of this step
EVAL = ["--eval-interval", str(HALF), "--eval-iters", "1"]   # Megatron's flags: validation at steps 3, 6 and the end
SGD_LR = 1e3   # large: the update lr x g dwarfs the weights, so (before - after) / lr is g to fp32 rounding
# The trace runs' learning rate: Megatron's schedule flags (Megatron's own scheduler, stepped by the engine:
# dcp_megatron/deepspeed/lr_schedule.py) in place of the JSON's "scheduler" block; decay over --train-iters.
PEAK_LR, MIN_LR, WARMUP = 3e-3, 3e-4, 2
SCHEDULE = ["--lr", str(PEAK_LR), "--min-lr", str(MIN_LR), "--lr-decay-style", "cosine", "--lr-warmup-iters", str(WARMUP)]
_LEARNING_RATE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?learning rate: ([0-9.E+-]+) \|")


def _reference_gradients(script, args, state, documents) -> dict:
    """One device, the whole global batch (every rank's share), per-token loss: the gradient DCP must reproduce."""
    import torch

    from dcp_megatron.core.microbatches import build_batch
    from dcp_megatron.planner.plan import NO_RECOMPUTE

    model, _ = script.build_model(args, has_gpu=False, bf16=False)
    model.load_state_dict(state)
    total, num_tokens = torch.zeros(()), int(documents.rows[:, 2].sum())
    for rows in documents.split():
        micro = build_batch([rows], cp_size=1, cp_rank=0, group=None, recompute=NO_RECOMPUTE, wave_index=0,
                            device=torch.device("cpu"))
        loss_sum, _ = script.forward_loss(model, micro)
        total = total + loss_sum
    (total / num_tokens).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}, float(total) / num_tokens


def _parameters(engine) -> dict:
    """Every parameter's full value (ZeRO-3 holds a partition per rank: gathered for the read)."""
    params = dict(engine.module.named_parameters())
    if engine.zero_optimization_stage() != 3:
        return {name: p.detach().clone() for name, p in params.items()}
    from deepspeed.runtime.zero import GatheredParameters

    with GatheredParameters(list(params.values())):
        return {name: p.detach().clone() for name, p in params.items()}


def _abandoned_scope_case(engine) -> dict:
    """ZeRO-2's coalesced reduction scope: flushed once when its block ends, not when the block raised (as when a
    collective timed out: the flush would wait another timeout for the same peer); the engine's flags reset."""
    engine_type = type(engine)
    original = engine_type._flush_coalesced_reduction_zero12
    flushes = []

    def counting_flush(self, optimizer):
        flushes.append(1)
        return original(self, optimizer)

    engine_type._flush_coalesced_reduction_zero12 = counting_flush
    try:
        with engine.coalesce_grad_reduction():
            pass
        after_normal = len(flushes)
        raised = None
        try:
            with engine.coalesce_grad_reduction():
                raise RuntimeError("Timed out waiting 21000ms for recv operation to complete")
        except RuntimeError as err:
            raised = str(err)
    finally:
        engine_type._flush_coalesced_reduction_zero12 = original
    return {"policy": "abandoned", "after_normal": after_normal, "after_error": len(flushes), "raised": raised,
            "inside_no_sync": engine.inside_no_sync_ctxt,
            "shadowed": any(name in vars(engine) for name in ("_flush_coalesced_reduction_zero12",
                                                                "_flush_coalesced_reduction_zero3"))}


def _parity_worker(rank, world_size, directory):
    import torch

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size))  # what torchrun sets
    from dcp_megatron import deepspeed_patches
    from dcp_megatron.deepspeed.arguments import parse_args
    from dcp_megatron.deepspeed.samples import SampleShares
    from dcp_megatron.deepspeed.setup import setup_training

    script = load_ds_script()
    results = []
    blend = write_blend(directory) if rank == 0 else None
    torch.distributed.barrier()
    blend = blend or blend_flags(directory)
    # ZeRO-1 with planned steps and the static layout run in the loss-trace and resume runs below; the blend
    # cases read Megatron's GPT datasets (two .bin/.idx corpora, weighted, --split) with and without --dcp.
    # ZeRO-3 plans in lockstep (every rank the same count: the weight gathers pair up), one relief per wave.
    for stage, policy in ((0, "dcp"), (2, "dcp"), (2, "ulysses"), (1, "blend_dcp"), (1, "blend_static"), (3, "dcp"),
                          (3, "ulysses"), (1, "gelu_mlp")):
        path = os.path.join(directory, f"sgd_z{stage}_{policy}.json")
        if rank == 0:
            config = ds_config(stage=stage, gradient_clipping=0.0, zero_allow_untested_optimizer=True,
                               optimizer={"type": "SGD", "params": {"lr": SGD_LR}})
            del config["scheduler"]   # a constant learning rate: update = lr x gradient at every step
            with open(path, "w") as f:
                json.dump(config, f)
        torch.distributed.barrier()
        flags = (GELU_WITH_BIASES if policy == "gelu_mlp" else TINY_MODEL) + ["--deepspeed-config", path,
                                                                              "--train-iters", "2"]
        if policy.startswith("blend"):
            flags = [f for f in flags if f != "--mock-data"] + blend
        budget = (Z3_RELIEF if policy == "dcp" else Z3_BUDGET) if stage == 3 else (
            GELU_RELIEF if policy == "gelu_mlp" else BUDGET)
        flags += ["--dcp", *budget, "--dcp-sync-planning"] if not policy.endswith("static") else []
        flags += ["--dcp-cp-attention", "ulysses"] if policy == "ulysses" else []
        flags += (["--dcp-cp-attention", "allgather", "--dcp-dump-plans", os.path.join(directory, "plans_z3_relief")]
                  if (stage, policy) == (3, "dcp") else [])
        args = parse_args(flags)
        training = setup_training(args, model_provider=script.build_model, forward_loss=script.forward_loss,
                                  patches=deepspeed_patches)
        engine = training.engine
        # The whole global batch, as one data-parallel rank would read it: every rank's share, in order.
        references = SampleShares(training.steps.shares.dataset, global_batch_size=args.global_batch_size,
                                  micro_batch_size=args.micro_batch_size, data_parallel_rank=0, data_parallel_size=1)
        # Two steps: with lr 1e3 a third would start from weights so large that attention saturates and fp32
        # summation order (CP attention merges blocks) decides the gradient, for any layout.
        for step in range(2):
            before = _parameters(engine)   # both ranks: ZeRO-3 gathers the partitions
            share = references.next_share()
            if rank != 0:   # the parity is rank 0's: the reference is computed there only
                training.steps.train_step(engine)
                _parameters(engine)
                continue
            expected, expected_loss = _reference_gradients(script, args, before, share)
            outcome = training.steps.train_step(engine)
            plan = training.steps.last_plan
            errors = [max_rel_err((before[name] - after) / SGD_LR, expected[name])
                      for name, after in _parameters(engine).items()]
            scale = max(float(g.abs().max()) for g in expected.values())
            assert 0 < scale < float("inf"), f"degenerate reference gradient (max |g| = {scale})"
            results.append({"stage": stage, "policy": policy, "step": step, "max_rel_err": max(errors),
                            "loss": outcome.loss, "loss_rel_err": abs(outcome.loss - expected_loss) / expected_loss,
                            "counts": [plan.num_microbatches(r) for r in range(plan.domain_size)],
                            "cp_sizes": sorted(plan.cp_size_histogram()), "ran": outcome.num_microbatches,
                            "lockstep": all(len(g.microbatches) == 1 for w in plan.waves for g in w.groups),
                            "fallback": plan.extra.get("fallback"), "recompute": sorted({
                                str(mb.recompute) for w in plan.waves for g in w.groups for mb in g.microbatches}),
                            "ulysses": sum(mb.attention == "ulysses" for w in plan.waves for g in w.groups
                                           for mb in g.microbatches)})
        if stage == 2 and policy == "dcp":
            results.append(_abandoned_scope_case(engine))
        training.close()
    # Every group created after the default one (Megatron's, the group pool's, DeepSpeed's copy of the world
    # that ZeRO reduces gradients on) carries the run's --distributed-timeout-minutes, not torch's default.
    from deepspeed.utils import groups as ds_groups

    default = torch.distributed.group.WORLD.group_name
    results.append({"policy": "timeouts", "deepspeed_world_s": group_timeout_s(ds_groups._WORLD_GROUP),
                    "others_s": sorted({s for name, s in group_timeouts_s().items() if name != default})})
    # A step whose loss is not finite (a weight turned NaN, as a diverged run's would) stops before the
    # optimizer applies it.
    args = parse_args(TINY_MODEL + ["--deepspeed-config", os.path.join(directory, "sgd_z2_dcp.json"),
                                    "--train-iters", "2", "--dcp", *BUDGET])
    training = setup_training(args, model_provider=script.build_model, forward_loss=script.forward_loss,
                              patches=deepspeed_patches)
    training.steps.train_step(training.engine)
    with torch.no_grad():
        next(training.engine.module.parameters()).view(-1)[0] = float("nan")
    before = [p.detach().clone() for p in training.engine.module.parameters()]
    try:
        training.steps.train_step(training.engine)
        stopped = None
    except FloatingPointError as err:
        stopped = str(err)
    unchanged = all(torch.equal(a, p.detach()) or (a.isnan() == p.detach().isnan()).all() and torch.equal(
        a.nan_to_num(), p.detach().nan_to_num()) for a, p in zip(before, training.engine.module.parameters()))
    training.close()
    results.append({"policy": "blowup", "stopped": stopped, "unchanged": unchanged})
    return results


def test_gradients_equal_one_device_on_the_whole_batch(tmp_path):
    results = run_distributed(_parity_worker, 2, str(tmp_path), timeout_s=600, max_rss_bytes=PARITY_MAX_RSS_BYTES)
    timeouts = [case for per_rank in results for case in per_rank if case["policy"] == "timeouts"]
    run_timeout_s = 60 * float(TINY_MODEL[TINY_MODEL.index("--distributed-timeout-minutes") + 1])
    assert len(timeouts) == 2 and all(c["deepspeed_world_s"] == run_timeout_s and c["others_s"] == [run_timeout_s]
                                      for c in timeouts), timeouts
    abandoned = [case for per_rank in results for case in per_rank if case["policy"] == "abandoned"]
    assert len(abandoned) == 2 and all(c["after_normal"] == 1 and c["after_error"] == 1 and "Timed out" in c["raised"]
                                       and not c["inside_no_sync"] and not c["shadowed"] for c in abandoned), abandoned
    rank0 = [case for case in results[0] if case["policy"] not in ("blowup", "timeouts", "abandoned")]
    blowup = [case for per_rank in results for case in per_rank if case["policy"] == "blowup"]
    assert all(c["stopped"] and "not finite" in c["stopped"] and c["unchanged"] for c in blowup), blowup
    for case in rank0:
        print(case)
        assert case["max_rel_err"] <= 1e-5 and case["loss_rel_err"] <= 1e-5, case
    # GELU MLP with biases under MLP recompute (ZeRO-1): some micro-batch recomputed its MLP, gradients exact (above)
    gelu = [c for c in rank0 if c["policy"] == "gelu_mlp"]
    assert len(gelu) == 2 and any("mlp" in c["recompute"] for c in gelu), gelu
    # Megatron's blended GPT datasets: the same losses with and without --dcp (and both equal one device's).
    blend = {(c["policy"], c["step"]): c["loss"] for c in rank0 if c["policy"].startswith("blend")}
    assert len(blend) == 4 and all(abs(blend["blend_dcp", s] - blend["blend_static", s]) <= 1e-5 * blend["blend_static", s]
                                   for s in (0, 1)), blend
    dcp = [c for c in rank0 if c["policy"] != "static"]
    assert all(c["ulysses"] > 0 for c in rank0 if c["policy"] == "ulysses"), "no micro-batch ran Ulysses"
    assert any(len(set(c["counts"])) > 1 for c in dcp), "no planned step gave the ranks different counts"
    assert any(len(c["cp_sizes"]) > 1 for c in dcp), "no planned step mixed CP sizes"
    # ZeRO-3: dcp's plans (its own layouts or a baseline's with dcp's per-wave relief; no baseline run as is),
    # lockstep: every rank the same count, one per group per wave
    zero3 = [c for c in rank0 if c["stage"] == 3]
    assert len(zero3) == 4 and all(c["lockstep"] and len(set(c["counts"])) == 1 and c["fallback"] is None
                                   for c in zero3), zero3
    assert any(len(c["cp_sizes"]) > 1 for c in zero3) and any(c["ulysses"] > 0 for c in zero3), zero3
    assert all(c["ulysses"] == 0 and 2 in c["cp_sizes"] for c in zero3 if c["policy"] == "dcp"), zero3  # all-gather CP
    # ZeRO-3 with recompute (the parity above holds for it): from the dumps, a wave recomputes full layers and every
    # micro-batch of each wave, an idle rank's filler too, runs its wave's relief; each rank's backward replayed
    # what its plan named (the trace beside the dumps)
    relief = tmp_path / "plans_z3_relief"
    plans = read_plan_dumps(relief, count=2)
    reliefs = [{mb.recompute for g in w.groups for mb in g.microbatches} for p in plans for w in p.waves]
    assert all(len(r) == 1 for r in reliefs) and any(next(iter(r)).kind == "full" for r in reliefs), reliefs
    assert any(len(w.groups) > 1 and next(iter(r)).kind == "full" for r, w in
               zip(reliefs, [w for p in plans for w in p.waves])), reliefs   # shared by separate CP groups
    for rank in range(2):
        for step, plan in enumerate(plans, start=1):
            assert microbatches_seen(relief, rank, step) == microbatches_planned(plan, rank), (rank, step)


def _half_checkpoint(run, save, half):
    """The step-HALF checkpoint of a run (which also saved at its end) in its own directory, `latest` -> it."""
    tag = f"iter_{HALF:07d}"
    if run.returncode == 0:
        shutil.copytree(save / tag, half / tag)
        (half / "latest").write_text(tag)
    return half


def _scheduled(*, stage: int, **extra) -> dict:
    """The runs' JSON without its "scheduler" block: the SCHEDULE flags set the learning rate."""
    config = ds_config(stage=stage, **extra)
    del config["scheduler"]
    return config


def _run(config: dict, flags: list[str], **options):
    return run_deepspeed(config, [*SCHEDULE, *flags], iters=ITERS, **options)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds")
    plans, save = root / "plans", root / "ckpt"
    # ZeRO-1 with --dcp in two launches: steps 1-3, stopped by --exit-interval, which saves (--save-interval is past
    # the stop), then the rest resumed from that checkpoint, dumping its plans and micro-batch traces beside the first
    # half's. Together they are the ZeRO-1 trace ("dcp_z1"); ZeRO-3 below runs its 6 steps in one launch.
    dcp_flags = ["--dcp", *BUDGET, *EVAL, "--dcp-dump-plans", str(plans)]
    first_half = _run(_scheduled(stage=1), [*dcp_flags, "--save", str(save), "--save-interval", str(ITERS),
                                            "--exit-interval", str(HALF)], directory=str(root))
    resumed = _run(_scheduled(stage=1), [*dcp_flags, "--load", str(save)], directory=str(root))
    dcp_z1 = parse_output(first_half.returncode or resumed.returncode, first_half.output + "\n" + resumed.output)
    # ZeRO-3 (lockstep plans, weights gathered per layer) with Ulysses on every CP micro-batch whose heads split
    # (the cost model never prefers it on 2 CPU ranks with GQA: the all-gather moves fewer bytes and hides them);
    # also DeepSpeed's TensorBoard monitor (the dcp/* scalars go through it) and ZeRO-3's checkpoint, resumed below
    save_z3 = root / "ckpt_z3"
    dcp_z3 = _run(_scheduled(stage=3, tensorboard={"enabled": True, "output_path": str(root / "ds_tb"),
                                                   "job_name": "dcp"}),
                  ["--dcp", *Z3_BUDGET, *EVAL, "--dcp-cp-attention", "ulysses", "--dcp-dump-plans",
                   str(root / "plans_z3"), "--save", str(save_z3), "--save-interval", str(HALF)], directory=str(root))
    half_z3 = _half_checkpoint(dcp_z3, save_z3, root / "ckpt_z3_half")
    return {
        "root": root, "plans": plans, "save": save, "dcp_z1": dcp_z1, "dcp_z1_first_half": first_half,
        "resumed": resumed, "dcp_z3": dcp_z3,
        "static": _run(_scheduled(stage=1), EVAL, directory=str(root)),
        "one_rank": _run(_scheduled(stage=0), EVAL, nproc=1, directory=str(root), torchrun=False),
        "resumed_z3": _run(_scheduled(stage=3), ["--dcp", *Z3_BUDGET, *EVAL, "--dcp-cp-attention", "ulysses",
                                                 "--load", str(half_z3)], directory=str(root)),
    }


def _megatron_logged_rates() -> dict[int, float]:
    """iteration -> the learning rate Megatron's loop logs after it: its scheduler stepped by one global batch per
    update, for the SCHEDULE flags over --train-iters ITERS."""
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    batch = int(TINY_MODEL[TINY_MODEL.index("--global-batch-size") + 1])
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=PEAK_LR)
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=PEAK_LR, min_lr=MIN_LR,
                                        lr_warmup_steps=WARMUP * batch, lr_decay_steps=ITERS * batch,
                                        lr_decay_style="cosine", start_wd=0.1, end_wd=0.1, wd_incr_steps=ITERS * batch,
                                        wd_incr_style="constant")
    rates = {}
    for iteration in range(1, ITERS + 1):
        scheduler.step(increment=batch)
        rates[iteration] = optimizer.param_groups[0]["lr"]
    return rates


def test_learning_rate_is_megatrons_schedule(runs):
    """Megatron's --lr/--min-lr/--lr-decay-style/--lr-warmup-iters on DeepSpeed: every run logs, after each
    iteration, the rate Megatron's loop logs for the same flags; the resumed runs (ZeRO-1, ZeRO-3) continue the
    scheduler's step count from DeepSpeed's checkpoint."""
    expected = _megatron_logged_rates()
    assert expected[1] == pytest.approx(PEAK_LR / 2) and expected[ITERS] == pytest.approx(MIN_LR)
    for name in ("dcp_z1", "dcp_z3", "static", "one_rank", "resumed", "resumed_z3"):   # dcp_z1: both halves
        logged = {int(m[1]): float(m[2]) for m in _LEARNING_RATE.finditer(runs[name].check().output)}
        first = HALF + 1 if name.startswith("resumed") else 1
        assert sorted(logged) == list(range(first, ITERS + 1)), (name, logged)
        assert all(logged[i] == pytest.approx(expected[i], rel=1e-5) for i in logged), (name, logged, expected)


def _close(trace, reference, tolerance=1e-5):
    assert len(trace) == len(reference) == ITERS, (trace, reference)
    worst = max(abs(a - b) / abs(b) for a, b in zip(trace, reference))
    assert worst <= tolerance, (worst, trace, reference)
    return worst


def test_loss_traces_agree_across_layouts(runs):
    reference = runs["one_rank"].check().loss_trace()
    # ZeRO-0 (gradients exact at every checked step, above) has no trace run of its own: the suite's 20 minutes.
    reference_norms = [runs["one_rank"].grad_norms[i] for i in sorted(runs["one_rank"].grad_norms)]
    for name in ("dcp_z1", "dcp_z3", "static"):
        print(name, _close(runs[name].check().loss_trace(), reference))
        # grad norms (printed to 6 digits) beside the losses: the same gradients, not only the same loss
        norms = [runs[name].grad_norms[i] for i in sorted(runs[name].grad_norms)]
        print(name, "grad norms", _close(norms, reference_norms, tolerance=1e-4))
    # No CPU flag was given: the script chose them and said so in one line (explicit flags win: not tested here).
    notice = "dcp: no GPU found, so this run uses --distributed-backend gloo --transformer-impl local"
    assert all(notice in runs[name].output for name in runs if name not in ("root", "plans", "save")), notice
    # Mock tokens are uniform (nothing to learn beyond ln 256): check the weights moved, not that loss fell.
    assert len(set(reference)) == len(reference) and all(n > 0 for n in runs["one_rank"].grad_norms.values())


def test_the_dynamic_path_ran(runs):
    plans = read_plan_dumps(runs["plans"])
    assert len(plans) == ITERS
    # Per rank and micro-batch, what ran (the CP group handed to the decoder, the recompute its backward replayed)
    # is what the plan named; some step runs different recompute kinds in its micro-batches.
    mixed = []
    for rank in range(2):
        for step, plan in enumerate(plans, start=1):
            seen = microbatches_seen(runs["plans"], rank, step)
            assert seen == microbatches_planned(plan, rank), (rank, step, seen)
            if len({recompute for _, recompute in seen}) > 1:
                mixed.append((rank, step))
    assert mixed, "no rank ran different recompute kinds in the micro-batches of one step"
    assert any(len(p.cp_size_histogram()) > 1 for p in plans), "no step mixed CP sizes"
    assert any(len({p.num_microbatches(r) for r in range(p.domain_size)}) > 1 for p in plans)
    assert any(mb.recompute.kind != "none" for p in plans for w in p.waves for g in w.groups for mb in g.microbatches)
    static = runs["static"].dcp_steps
    # Megatron's layout: one CP size for the run, packed micro-batches dealt in order (counts differ by <= 1)
    assert static and all(s["policy"] == "static" and max(s["counts"]) - min(s["counts"]) <= 1 for s in static.values())
    assert len({s["cp_sizes"].split("x")[0] for s in static.values()}) == 1
    dynamic = runs["dcp_z3"].dcp_steps
    # The label names a baseline's layout (dcp(fallback:static), or dcp(seeded:<baseline>) with dcp's own reliefs): a
    # step where a baseline's layout is faster by the model (its run-wide relief is one per wave, so ZeRO-3 runs it;
    # measured times from step 4 may add some) runs it; most steps are dcp's own.
    assert sorted(dynamic) == list(range(1, ITERS + 1)) and all(is_own_plan(s["policy"]) or s["policy"].startswith(
        ("dcp(fallback:", "dcp(seeded:")) for s in dynamic.values()), dynamic
    assert sum(is_own_plan(s["policy"]) for s in dynamic.values()) >= ITERS // 2, {
        k: s["policy"] for k, s in dynamic.items()}
    ulysses = read_plan_dumps(runs["root"] / "plans_z3")
    assert len(ulysses) == ITERS and all(mb.attention == "ulysses" for p in ulysses for w in p.waves for g in w.groups
                                      if g.size > 1 for mb in g.microbatches if mb.sequences)
    assert any(g.size > 1 for p in ulysses for w in p.waves for g in w.groups)
    # ZeRO-3's plans are lockstep: one micro-batch per group per wave, so every rank runs the same count
    assert all(len(g.microbatches) == 1 for p in ulysses for w in p.waves for g in w.groups)
    assert all(len({p.num_microbatches(r) for r in range(p.domain_size)}) == 1 for p in ulysses)
    # and each wave's micro-batches share one relief (ZeRO-3's weight gathers pair only so); what ran is what it named
    assert all(len({mb.recompute for g in w.groups for mb in g.microbatches}) == 1 for p in ulysses for w in p.waves)
    assert all(microbatches_seen(runs["root"] / "plans_z3", rank, step) == microbatches_planned(plan, rank)
               for rank in range(2) for step, plan in enumerate(ulysses, start=1))
    assert all(mb.attention == "allgather" for p in plans for w in p.waves for g in w.groups for mb in g.microbatches)


# ZeRO-1's uninterrupted trace: one device's (every layout's to 1e-5, test_loss_traces_agree_across_layouts)
@pytest.mark.parametrize("resumed_run, full_run", [("resumed", "one_rank"), ("resumed_z3", "dcp_z3")])
def test_resume_continues_the_trace(runs, resumed_run, full_run):
    resumed = runs[resumed_run].check()
    assert "resumed from" in resumed.output and f"at iteration {HALF}" in resumed.output
    assert sorted(resumed.losses) == list(range(HALF + 1, ITERS + 1))
    full = runs[full_run].check().losses
    for iteration, loss in resumed.losses.items():
        assert abs(loss - full[iteration]) <= 1e-5 * abs(full[iteration]), (iteration, loss, full[iteration])
    # the validation data continues where the checkpoint left it (Megatron's consumed_valid_samples)
    evals, full_evals = resumed.eval_losses, runs[full_run].eval_losses
    assert sorted(evals) == [ITERS] and abs(evals[ITERS] - full_evals[ITERS]) <= 1e-5 * full_evals[ITERS], (evals,
                                                                                                     full_evals)


def test_evaluation_is_the_same_for_every_layout(runs):
    """--eval-interval / --eval-iters (Megatron's flags): the validation split's batches, planned as training steps
    (dcp's plans, ZeRO-3's lockstep ones, the static layout) and run forward only, give one device's loss."""
    reference = runs["one_rank"].check().eval_losses
    assert sorted(reference) == [HALF, ITERS] and len(set(reference.values())) == 2, reference
    for name in ("dcp_z1", "dcp_z3", "static"):
        evals = runs[name].check().eval_losses
        assert sorted(evals) == [HALF, ITERS], (name, evals)
        assert all(abs(evals[i] - reference[i]) <= 1e-5 * reference[i] for i in evals), (name, evals, reference)
        assert "validation loss at the end of training for val data" in runs[name].output, name


def test_deepspeed_monitor_holds_the_dcp_scalars(runs):
    """DeepSpeed's TensorBoard monitor (its config's "tensorboard" section) receives the dcp/* scalars of
    every step; the predicted step time is the dumped plan's."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs["dcp_z3"].check()
    events = EventAccumulator(str(runs["root"] / "ds_tb" / "dcp"), size_guidance={"scalars": 0})
    events.Reload()
    tags = events.Tags()["scalars"]
    plans = read_plan_dumps(runs["root"] / "plans_z3")
    for tag in ("dcp/predicted_step_s", "dcp/measured_step_s", "dcp/microbatches_per_rank_max", "dcp/tokens_padded",
                "dcp/recompute_share", "dcp/planning_s", "dcp/predicted_unrefined_s"):
        assert tag in tags, (tag, tags)
        assert [e.step for e in events.Scalars(tag)] == list(range(1, ITERS + 1)), tag
    predicted = [e.value for e in events.Scalars("dcp/predicted_step_s")]
    assert predicted == pytest.approx([p.est_step_time_s for p in plans], rel=1e-6)
    counts = [max(p.num_microbatches(r) for r in range(p.domain_size)) for p in plans]
    assert [e.value for e in events.Scalars("dcp/microbatches_per_rank_max")] == counts


def test_exit_interval_saves_and_stops_as_megatrons_loop(runs):
    """--exit-interval (issue 46: ran past it): the ZeRO-1 run saves and stops after the first step the interval
    divides (its --save-interval is past it: the save is the exit's; the resumed run loads it), and each iteration
    line says which iteration's learning rate it shows (the engine's scheduler steps after the update, so the rate
    read after iteration N is iteration N + 1's)."""
    run = runs["dcp_z1_first_half"].check()
    assert sorted(run.losses) == list(range(1, HALF + 1)), run.output[-3000:]
    assert f"exiting at iteration {HALF} (--exit-interval {HALF})" in run.output
    assert f"saving checkpoint at iteration {HALF}" in run.output and (runs["save"] / "latest").is_file()
    assert "at the end of training" not in run.output   # as Megatron's loop: no final evaluation after an exit
    labels = re.findall(r"iteration\s+(\d+)/\s*\d+ \|.*?learning rate: [0-9.E+-]+ \| \(the rate of iteration (\d+)\)",
                        run.output)
    assert [(int(a), int(b)) for a, b in labels] == [(i, i + 1) for i in range(1, HALF + 1)], run.output[-3000:]
