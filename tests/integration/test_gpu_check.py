"""tools/gpu_check.sh's CPU side: its argument checks, the commands it would run (every flag one Megatron and
--dcp know), the memory budget that makes recompute switch, and how it judges a training log."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from dcp_megatron.planner.plan import NO_RECOMPUTE, Group, MicroBatch, Recompute, StepPlan, Wave
from tests.support.tool_helpers import TOOLS_DIR, load_tool

gpu_check = load_tool("gpu_check")
SCRIPT = str(TOOLS_DIR / "gpu_check.sh")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([SCRIPT, *args], capture_output=True, text=True, timeout=300)


def test_dry_run_lists_every_step_and_refuses_bad_arguments_and_a_machine_without_gpu(tmp_path):
    dry = _run("--dry-run", "--out", str(tmp_path / "out"), "--profiles", str(tmp_path / "profiles"))
    assert dry.returncode == 0, dry.stderr[-2000:]
    report = json.loads(dry.stdout)
    assert [s["name"] for s in report["steps"]] == list(gpu_check.STEPS)
    assert "NCCL refuses two ranks on one device" in report["not_checked"]
    steps = {s["name"]: s for s in report["steps"]}
    for name in ("train_bf16", "train_fp8"):
        argv = steps[name]["argv"]
        assert argv[argv.index("--transformer-impl") + 1] == "transformer_engine"
        assert "--bf16" in argv and "--dcp" in argv
        assert ("--fp8-format" in argv) == (name == "train_fp8")
    assert steps["profile_fp8"]["profile"] == str(tmp_path / "profiles" / "h200_fp8.json")
    assert "dcp_megatron.profile" in steps["profile_bf16"]["argv"]
    assert not (tmp_path / "out").exists()                       # a dry run writes nothing
    assert steps["offload"]["argv"][1].endswith("tools/gpu_check_offload.py")
    assert steps["offload"]["argv"][2] == str(tmp_path / "out")   # where the probe writes offload.json
    skipped = json.loads(_run("--dry-run", "--skip", "profile_bf16,profile_fp8").stdout)
    assert [s["name"] for s in skipped["steps"]] == ["te_attention", "train_bf16", "train_fp8", "offload", "memory"]
    assert steps["memory"]["argv"][1:] == [os.path.join(gpu_check.REPO, "tools", "gpu_check_memory.py"),
                                           str(tmp_path / "out")]
    bad = _run("--skip", "nothing")
    assert bad.returncode == 2 and "--skip: unknown steps ['nothing']" in bad.stderr
    if not _has_gpu():
        no_gpu = _run("--out", str(tmp_path / "out"))
        assert no_gpu.returncode == 2 and "no GPU visible to torch" in no_gpu.stderr


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def test_training_flags_are_ones_megatron_and_dcp_parse():
    pytest.importorskip("megatron.training")
    from megatron.training.arguments import parse_args

    from dcp_megatron.flags.dcp_flags import add_dcp_arguments

    steps = {s["name"]: s for s in gpu_check.build_steps(out="/tmp/o", profiles="/tmp/p", python="python")}
    for name in ("train_fp8", "profile_fp8"):
        argv = steps[name]["argv"]
        script = next(i for i, a in enumerate(argv) if a.endswith("pretrain_gpt.py")) if "--" not in argv else None
        start = argv.index("--") if script is None else script
        args = _parse_with_argv(parse_args, add_dcp_arguments, argv[start + 1:])
        assert (args.fp8, args.fp8_recipe, args.transformer_impl) == ("hybrid", "tensorwise", "transformer_engine")
        assert args.dcp and (name == "profile_fp8" or args.dcp_recompute == "none,full")


def _parse_with_argv(parse_args, extra, flags):
    import sys

    saved = sys.argv
    sys.argv = ["pretrain_gpt.py", *flags]
    try:
        return parse_args(extra_args_provider=extra, ignore_unknown_args=False)
    finally:
        sys.argv = saved


def test_the_budget_makes_long_documents_recompute_and_short_ones_not():
    from dcp_megatron.planner.costmodel import CostModel, GiB, GpuCosts, ModelShape, cluster_preset

    model = gpu_check.TRAIN_MODEL
    for fp8 in (False, True):
        budget = gpu_check.recompute_switching_budget_gb(model, fp8=fp8)
        shape = ModelShape(num_layers=model["num_layers"], hidden_size=model["hidden_size"],
                           num_heads=model["num_heads"], num_kv_heads=model["num_kv_heads"],
                           head_dim=model["hidden_size"] // model["num_heads"],
                           ffn_hidden_size=model["ffn_hidden_size"],
                           vocab_size=32128, gated_mlp=True)
        cluster = dataclasses.replace(cluster_preset("h200", domain_size=1), mem_bytes_per_gpu=int(budget * GiB))
        cost = CostModel(shape, cluster, gpu=GpuCosts(fp8=fp8, cp_ring=True, communicators=True))
        assert cost.best_recompute([gpu_check.SEQ_LENGTH], 1) not in (None, NO_RECOMPUTE)
        assert cost.best_recompute([gpu_check.SEQ_LENGTH // 4], 1) == NO_RECOMPUTE


def _log(plans) -> str:
    from dcp_megatron.core.plan_log import plan_summary

    lines = []
    for i, plan in enumerate(plans, 1):
        lines.append(f" [2026-12-02] iteration        {i}/       6 | lm loss: 1.05E+01 |")
        lines.append(f" dcp iteration {i:8d} | {plan_summary(plan)} | predicted (ms): 1.0")
    return "\n".join(lines)


def _plan(*recomputes) -> StepPlan:
    mbs = tuple(MicroBatch(((j, 100),), recompute=r) for j, r in enumerate(recomputes))
    return StepPlan(domain_size=1, waves=(Wave((Group(0, 1, mbs),)),))


def test_a_training_step_passes_only_when_it_trained_and_switched_recompute():
    step = {"name": "train_bf16"}
    full = Recompute("full", 4)
    mixed = gpu_check.judge(step, 0, _log([_plan(NO_RECOMPUTE, full, NO_RECOMPUTE)]))
    assert mixed["passed"] and mixed["microbatches_and_recomputed_per_step"] == [(3, 1)]
    across = gpu_check.judge(step, 0, _log([_plan(NO_RECOMPUTE), _plan(full, full)]))
    assert across["passed"]
    never = gpu_check.judge(step, 0, _log([_plan(NO_RECOMPUTE), _plan(NO_RECOMPUTE)]))
    assert not never["passed"] and not never["recompute_switched"]
    always = gpu_check.judge(step, 0, _log([_plan(full, full)]))
    assert not always["passed"]
    assert not gpu_check.judge(step, 1, _log([_plan(NO_RECOMPUTE, full)]))["passed"]
    nan = _log([_plan(NO_RECOMPUTE, full)]).replace("1.05E+01", "nan")
    assert not gpu_check.judge(step, 0, nan)["passed"]


def test_profiles_merge_the_fp8_gemm_rate(tmp_path):
    (tmp_path / "h200_bf16.json").write_text(json.dumps({"gemm_flops": 5e14, "meta": {}}))
    assert gpu_check.merge_profiles(str(tmp_path)) is None           # the FP8 profile is missing
    (tmp_path / "h200_fp8.json").write_text(json.dumps({"gemm_flops": 9e14}))
    merged = json.loads(open(gpu_check.merge_profiles(str(tmp_path))).read())
    assert merged["gemm_flops"] == 5e14 and merged["fp8_gemm_flops"] == 9e14
    from dcp_megatron.planner.costmodel.cost_profile import check_profile

    check_profile(merged)
    assert os.path.basename(merged["meta"]["fp8_from"]) == "h200_fp8.json"


def test_the_offload_step_passes_only_on_the_probes_own_verdict(tmp_path):
    step = {"name": "offload", "log": str(tmp_path / "offload.log")}
    assert not gpu_check.judge(step, 0, "")["passed"]                      # no report: failed
    (tmp_path / "offload.json").write_text(json.dumps({"passed": True, "parity_passed": True,
                                                       "memory_passed": True, "peak_fell_by": 1 << 28}))
    assert gpu_check.judge(step, 0, "")["passed"]
    assert not gpu_check.judge(step, 1, "")["passed"]                      # the probe exited non-zero
    (tmp_path / "offload.json").write_text(json.dumps({"passed": False, "memory_passed": False}))
    judged = gpu_check.judge(step, 0, "")
    assert not judged["passed"] and judged["memory_passed"] is False       # the report says which check failed


def test_the_memory_step_passes_on_its_probes_verdict_and_its_plumbing_runs_on_cpu(tmp_path):
    """tools/gpu_check_memory.py: judged on its own report; on CPU (--cpu-smoke) it runs one micro-batch per relief
    through DCP's step path and writes the planner's count for each (measured only on a GPU)."""
    step = {"name": "memory", "log": str(tmp_path / "memory.log")}
    assert not gpu_check.judge(step, 0, "")["passed"]
    (tmp_path / "memory.json").write_text(json.dumps({"passed": False, "reliefs": {"none": {"within_margin": False}}}))
    assert not gpu_check.judge(step, 0, "")["passed"]
    (tmp_path / "memory.json").write_text(json.dumps({"passed": True}))
    assert gpu_check.judge(step, 0, "")["passed"] and not gpu_check.judge(step, 1, "")["passed"]
    smoke = subprocess.run([sys.executable, os.path.join(gpu_check.REPO, "tools", "gpu_check_memory.py"),
                            "--cpu-smoke", str(tmp_path / "smoke")], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PYTHONPATH": gpu_check.REPO})
    assert smoke.returncode == 0, smoke.stderr[-3000:]
    with open(tmp_path / "smoke" / "memory.json") as f:
        report = json.load(f)
    counted = {name: row["counted_bytes"] for name, row in report["reliefs"].items()}
    # the memory probe's table: each relief's micro-batch read as the probe reads it (saved bytes on CPU), against
    # the count of that quantity, and the factor the probe would set from it
    for name, row in report["reliefs"].items():
        probe = row["probe"]
        assert probe["kind"] == "saved" and probe["measured_bytes"] > 0 and probe["counted_bytes"] > 0, name
        ratio = probe["measured_bytes"] / probe["counted_bytes"]
        assert probe["factor"] == report["probe_factors"][row["relief"]] == pytest.approx(max(1.0, ratio * 1.05))
    assert "relief           probe reads" in smoke.stdout
    assert list(counted) == ["none", "mlp", "core_attn", "core_attn+mlp", "full1", "full2"]
    assert counted["none"] > counted["mlp"] > counted["core_attn+mlp"] and counted["full2"] < counted["full1"]


def test_on_an_h100_the_check_reports_the_device_read_and_the_budget_it_would_choose(tmp_path):
    """The lent GPU may be an H100 or an H200: the memory step's `device` section (a fake 80 GB H100 reading here)
    names the H100's preset and the budget from its memory (not an H200's 141 GB), with the line a run prints;
    the profiles are named by the device's preset."""
    from tests.unit.test_device_budget import H100

    sys.path.insert(0, str(TOOLS_DIR))
    import gpu_check_memory

    cost = gpu_check_memory.counted_model(dict(num_layers=2, hidden_size=64, num_heads=4, ffn_hidden_size=128,
                                               vocab=128), cuda=False)
    section = gpu_check_memory.device_section(H100, cost)
    assert section["preset"] == "h100-sxm" and section["name"] == H100.name
    # the tiny model's static count is below the 2 GiB the fake run holds: the difference is taken off
    held_beyond = H100.allocated_bytes - section["static_bytes"]
    assert section["budget_bytes"] == H100.free_bytes + H100.reserved_bytes - held_beyond < 80 * 2 ** 30
    assert len(section["lines"]) == 1 and "h100-sxm" in section["lines"][0] and "budget" in section["lines"][0]
    steps = {s["name"]: s for s in gpu_check.build_steps(out=str(tmp_path), profiles=str(tmp_path / "p"),
                                                         python=sys.executable, preset="h100-sxm")}
    assert steps["profile_bf16"]["profile"] == str(tmp_path / "p" / "h100-sxm_bf16.json")
