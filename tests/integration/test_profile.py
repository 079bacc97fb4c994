"""The profiler: fitting (costmodel/profile_fit.py), the grid, the in-model probes, and one real dcp-profile run.

The fit is checked against a known cost model: micro-batches "measured" by a CostModel with a known
profile are fitted, and the fitted profile must recover its constants and predict the held-back
points. The real run profiles the tiny Llama of tests/support/megatron_runs.py through our script on 2 CPU
ranks (with 1 of its 2 layers) and its profile must drive the planner.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from dcp_megatron.training.profiler import profile_cp_sizes, profile_grid
from dcp_megatron.planner.costmodel import CostModel, ModelShape, cpu_cluster
from dcp_megatron.planner.costmodel.cost_profile import check_profile, load_profile
from dcp_megatron.planner.costmodel.cost_time import CP_PASSES
from dcp_megatron.planner.plan import NO_RECOMPUTE
from dcp_megatron.planner.costmodel.profile_fit import (Measurement, fit_profile, local_tokens, scaled_to_stage,
                                                        score_profile)
from tests.support.megatron_runs import CPU_FLAGS, LLAMA_TINY, REPO, run_env

SHAPE = ModelShape(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, ffn_hidden_size=128,
                   vocab_size=256, gated_mlp=True, tp=1, pp=1)
TRUTH = {"gemm_flops": 9e9, "microbatch_overhead_s": 0.015, "document_overhead_s": 0.002,
         "collective_latency_s": 0.001, "intra_node_bw": 5e8, "inter_node_bw": 5e8, "recompute_cost_factor": 1.4,
         "attention_times": [[L, cp, 2e-3 * (L / 64) ** 1.6 / cp] for cp in (1, 2) for L in (64, 128, 256, 512, 1024)],
         "activation_bytes_per_hidden": {"none": 70.0, "selective": 66.0, "full": 8.0}, "output_bytes_per_vocab": 5.0}


def synthetic_measurements(noise: float = 0.0, seed: int = 0) -> list[Measurement]:
    """The profiler's grid as a cost model with the TRUTH profile would measure it (times x lognormal noise)."""
    truth = CostModel(SHAPE, cpu_cluster(2), profile=check_profile(json.loads(json.dumps(TRUTH))))
    rng = np.random.default_rng(seed)
    out = []
    for point in profile_grid(1024, [1, 2], SHAPE.num_layers, ("none", "selective", "full")):
        local, _, attn = truth._sums(point.lengths, point.cp_size)
        fixed = TRUTH["collective_latency_s"] * SHAPE.num_layers * CP_PASSES if point.cp_size > 1 else 0.0
        seconds = truth.microbatch_time(point.lengths, point.cp_size, recompute=point.recompute)
        factor = float(np.exp(rng.normal(0.0, noise))) if noise else 1.0
        saved = local * truth.held_bytes_per_local_token(point.recompute)
        outside = local * TRUTH["output_bytes_per_vocab"] * SHAPE.vocab_size
        out.append(Measurement(lengths=point.lengths, cp_size=point.cp_size, recompute=point.recompute,
                               seconds=seconds * factor, attention_seconds=(attn + fixed) * factor,
                               saved_bytes=saved, block_saved_bytes=saved - outside, held_back=point.held_back))
    return out


def test_fit_recovers_a_known_cost_model_and_predicts_its_held_back_points():
    measurements = synthetic_measurements()
    profile = fit_profile(measurements, SHAPE, cpu_cluster(2), intra_node_bw=5e8, collective_latency_s=1e-4)
    for key in ("gemm_flops", "microbatch_overhead_s", "document_overhead_s", "collective_latency_s",
                "recompute_cost_factor", "output_bytes_per_vocab"):
        assert profile[key] == pytest.approx(TRUTH[key], rel=0.02), key
    for kind, value in TRUTH["activation_bytes_per_hidden"].items():
        assert profile["activation_bytes_per_hidden"][kind] == pytest.approx(value, rel=1e-6)
    truth_rows = {(L, cp): t for L, cp, t in TRUTH["attention_times"]}
    for L, cp, t in profile["attention_times"]:
        assert t == pytest.approx(truth_rows[(L, cp)], rel=0.02), (L, cp)
    report = score_profile(profile, measurements, SHAPE, cpu_cluster(2))
    assert report["num_held_back"] >= 10 and report["num_fitted"] >= 10
    assert report["max_rel_error"] < 0.05 and report["memory_max_rel_error"] < 1e-6
    assert {"median_rel_error", "max_rel_error", "points"} <= set(report)


def test_fit_is_robust_to_timing_noise():
    measurements = synthetic_measurements(noise=0.05, seed=3)
    profile = fit_profile(measurements, SHAPE, cpu_cluster(2), intra_node_bw=5e8, collective_latency_s=1e-4)
    report = score_profile(profile, measurements, SHAPE, cpu_cluster(2))
    assert report["median_rel_error"] < 0.10


def test_scaled_profile_charges_the_trained_layers():
    profile = fit_profile(synthetic_measurements(), SHAPE, cpu_cluster(2), intra_node_bw=5e8,
                          collective_latency_s=1e-4)
    scaled = scaled_to_stage(profile, profiled_layers=2, layers_per_stage=8)
    assert scaled["microbatch_overhead_s"] == pytest.approx(4 * profile["microbatch_overhead_s"])
    assert [r[2] for r in scaled["attention_times"]] == pytest.approx([4 * r[2] for r in profile["attention_times"]])
    assert scaled["gemm_flops"] == profile["gemm_flops"]


def test_grid_covers_lengths_packing_recompute_and_cp_sizes():
    assert profile_cp_sizes(8, None) == [1, 2, 4, 8] and profile_cp_sizes(6, 4) == [1, 2] and profile_cp_sizes(1, None) == [1]
    grid = profile_grid(4096, [1, 2, 4], 6, ("none", "full"))
    assert {p.cp_size for p in grid} == {1, 2, 4}
    assert {str(p.recompute) for p in grid} == {"none", "full1", "full3", "full6"}   # no selective: not allowed
    for point in grid:
        assert sum(point.lengths) <= 4096 and min(point.lengths) >= 32 * point.cp_size
    for held in (True, False):
        assert any(len(p.lengths) > 1 and p.held_back is held for p in grid)    # packed, fitted and held back
        assert any(p.recompute != NO_RECOMPUTE and p.held_back is held for p in grid)
    singles = sorted(p.lengths[0] for p in grid if p.cp_size == 1 and len(p.lengths) == 1 and not p.held_back
                     and p.recompute == NO_RECOMPUTE)
    assert singles[0] == 64 and singles[-1] == 4096


def test_profile_keys_are_checked():
    with pytest.raises(ValueError, match="activation_bytes_per_hidden"):
        check_profile({"activation_bytes_per_hidden": {"none": 34, "bogus": 1}})
    with pytest.raises(ValueError, match="activation_bytes_per_hidden"):
        check_profile({"activation_bytes_per_hidden": {"none": float("nan")}})
    with pytest.raises(ValueError, match="output_bytes_per_vocab"):
        check_profile({"output_bytes_per_vocab": -1})
    with pytest.raises(ValueError, match="document_overhead_s"):
        check_profile({"document_overhead_s": "0.1"})
    with pytest.raises(ValueError, match="positive document lengths"):
        Measurement(lengths=(), cp_size=1, recompute=NO_RECOMPUTE, seconds=1, attention_seconds=0, saved_bytes=0,
                    block_saved_bytes=0)


class _CoreAttention(torch.nn.Module):
    def forward(self, query, key, value, mask=None):
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True)


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attention = torch.nn.Module()
        self.self_attention.core_attention = _CoreAttention()
        self.proj = torch.nn.Linear(8, 8, bias=False)

    def forward(self, x):
        return self.proj(self.self_attention.core_attention(x, x, x))


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Layer(), _Layer()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(8))
        self.decoder = _Block()

    def forward(self, x):
        return (self.decoder(x * self.scale) ** 2).sum()


def test_probes_time_the_core_attention_and_split_saved_bytes_at_the_block():
    from dcp_megatron.training.forward_step import Clock
    from dcp_megatron.training.profile_probes import AttentionTimer, SavedBytesMeter

    model = _Model()
    timer, meter = AttentionTimer([model], Clock(cuda=False, host_clock=time.process_time)), SavedBytesMeter([model])
    x = torch.randn(1, 2, 64, 8, requires_grad=True)
    with meter:
        loss = model(x)
    loss.backward()
    assert timer.found and len(timer.pairs) == 4           # forward and backward of each layer's attention
    assert timer.seconds() > 0
    # outside the block: `x` (for x * scale; the parameter is not an activation) and the block's output (for ** 2)
    assert meter.saved_bytes - meter.block_saved_bytes == 2 * x.untyped_storage().nbytes()
    assert meter.block_saved_bytes > 0
    with torch.no_grad():
        model(x)                                           # no-grad forwards (recompute's first pass) are not timed
    assert len(timer.pairs) == 4
    timer.remove()
    meter.remove()
    assert "timed_forward" not in model.decoder.layers[0].self_attention.core_attention.forward.__name__


def test_profile_command_line_errors_name_the_flag(tmp_path, capsys):
    from dcp_megatron.profile import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--out", str(tmp_path / "p.json"), "--layers", "3", "--", "--num-layers", "2"])
    assert exit_info.value.code == 2 and "--layers must be between 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", str(tmp_path / "p.json"), "--", "--hidden-size", "64"])
    assert exit_info.value.code == 2 and "--num-layers" in capsys.readouterr().err


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """One real dcp-profile run: 2 CPU ranks, the tiny Llama with 1 of its 2 layers, one timed pass."""
    out = tmp_path_factory.mktemp("profile")
    profile, report = out / "profile.json", out / "report.json"
    command = [sys.executable, os.path.join(REPO, "tools", "profile.py"), "--nproc", "2", "--layers", "1",
               "--repeats", "1", "--out", str(profile), "--report", str(report), "--",
               *LLAMA_TINY, *CPU_FLAGS, "--train-iters", "4", "--seq-length", "512", "--max-position-embeddings", "512"]
    proc = subprocess.run(command, cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=600)
    return proc, profile, report


def test_dcp_profile_writes_a_profile_the_planner_uses_and_a_held_back_report(profiled):
    proc, profile_path, report_path = profiled
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    assert "dcp-profile [########################]" in output and "held-back micro-batch" in output
    assert "iteration        1/" not in output                     # profiled instead of trained
    profile, report = load_profile(str(profile_path)), json.loads(report_path.read_text())
    assert profile["meta"]["profiled_layers"] == 1 and profile["meta"]["trained_layers"] == 2
    assert math.isfinite(report["median_rel_error"]) and report["max_rel_error"] >= report["median_rel_error"]
    assert report["num_held_back"] == len(report["points"]) > 10 and report["preset_median_rel_error"] > 0
    assert {p["cp_size"] for p in report["points"]} == {1, 2}
    for point in report["points"]:
        assert point["seconds"] > 0 and point["saved_bytes"] > 0 and 0 < point["block_saved_bytes"] < point["saved_bytes"]
    # the written profile is the 2-layer model's: it drives the planner's cost model for the trained shape
    trained = ModelShape(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                         ffn_hidden_size=128, vocab_size=256, gated_mlp=True, tp=1, pp=1)
    cost = CostModel(trained, cpu_cluster(2), profile=profile)
    assert cost.microbatch_time([1024], 2) > cost.microbatch_time([512], 2) > 0
    assert cost.bytes_per_local_token(NO_RECOMPUTE) == pytest.approx(
        2 * profile["activation_bytes_per_hidden"]["none"] * 64 + profile["output_bytes_per_vocab"] * 256)
    assert local_tokens([1000], 2) == 500


def test_tools_profile_on_sys_path_does_not_hide_the_standard_library_profile():
    """`python tools/X.py` puts tools/ first on sys.path; torch.distributed.checkpoint imports cProfile, which
    imports `profile`: tools/profile.py must then be the standard library's module."""
    code = "import sys; sys.path.insert(0, 'tools'); import cProfile, profile; print(profile.run.__module__)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "profile", proc.stderr[-2000:]
