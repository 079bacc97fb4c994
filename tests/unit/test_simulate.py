"""dcp-simulate end to end, in process, on small settings; the report's definitions; bad input."""
import json
import math

import pytest

from dcp_megatron.planner.plan import StepPlan
from dcp_megatron.simulate import SimulationConfig, cut_batches, main, simulate
from dcp_megatron.simulate_report import PolicyRun, format_table, summarize
from tests.support.tool_helpers import load_tool

POLICIES = ("static", "static-balanced", "megatron-hybrid", "megatron-dynamic", "dcp")
METRIC_KEYS = {"mean_step_s", "tokens_per_s", "speedup_vs_static", "speedup_vs_best_baseline", "lb_ratio_p50",
               "lb_ratio_p95", "peak_mem_frac", "plan_ms_p50", "plan_ms_p99"}
SMALL = ["--model", "llama3-8b", "--cluster", "h200", "--gpus", "8", "--gpus-per-node", "4",
         "--tokens-per-step", "131072", "--steps", "3", "--seed", "1"]


@pytest.fixture(scope="module")
def wikipedia_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sim")
    argv = ["--lengths", "builtin:wikipedia", *SMALL, "--json", str(out / "r.json"),
            "--plot", str(out / "t.png"), "--plot-step", "1", "--dump-plans", str(out / "plans")]
    assert main(argv) == 0
    return out, json.loads((out / "r.json").read_text())


def test_json_report_has_every_policy_and_metric(wikipedia_run):
    _, report = wikipedia_run
    assert set(report["policies"]) == set(POLICIES)
    config = report["config"]
    assert config["domain_size"] == 8 and config["num_batches"] == 3 and config["lengths"] == "builtin:wikipedia"
    for name, metrics in report["policies"].items():
        assert METRIC_KEYS <= set(metrics), name
        for key in METRIC_KEYS:
            assert math.isfinite(metrics[key]) and metrics[key] > 0, (name, key)
        assert metrics["lb_ratio_p50"] >= 1.0 - 1e-9 and metrics["peak_mem_frac"] < 1.0
    assert report["policies"]["static"]["speedup_vs_static"] == pytest.approx(1.0)


def test_dumped_plans_parse_cover_each_batch_and_match_the_report(wikipedia_run):
    from dcp_megatron.planner.timeline import plan_makespan

    out, report = wikipedia_run
    batches, _ = cut_batches(SimulationConfig(lengths="builtin:wikipedia", gpus=8, gpus_per_node=4,
                                              tokens_per_step=131072, steps=3, seed=1))
    for name in POLICIES:
        makespans = []
        for batch in batches:
            text = (out / "plans" / name / f"step_{batch.step}.json").read_text()
            plan = StepPlan.from_json(text)
            assert plan.dumps() == text
            assert sorted(plan.sequences()) == sorted(batch.sequences)
            makespans.append(plan_makespan(plan))
        # the policy's own estimates agree with the simulator's re-scoring by the shared cost model
        assert sum(makespans) / len(makespans) == pytest.approx(report["policies"][name]["mean_step_s"], rel=1e-6)


def test_plot_is_a_png_and_draw_plan_redraws_dumps(wikipedia_run, tmp_path):
    out, _ = wikipedia_run
    assert (out / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    draw_plan = load_tool("draw_plan")
    target = tmp_path / "two.png"
    assert draw_plan.main([str(out / "plans" / "static" / "step_0.json"),
                           str(out / "plans" / "dcp" / "step_0.json"), "--out", str(target)]) == 0
    assert target.read_bytes()[:4] == b"\x89PNG"


def test_lengths_file_run_and_table(tmp_path, capsys):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in [300, 12000, 40, 900, 65000, 7, 2048] * 6) + "\n")
    assert main(["--lengths", str(lengths), *SMALL, "--policies", "static,dcp", "--json", str(tmp_path / "r.json")]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["config"]["max_seq_len"] == 65000          # longest document of the run
    assert report["policies"]["static"]["speedup_vs_best_baseline"] is None   # no other baseline ran
    assert report["policies"]["dcp"]["speedup_vs_best_baseline"] == pytest.approx(
        report["policies"]["dcp"]["speedup_vs_static"])
    printed = capsys.readouterr().out
    assert "| static" in printed and "| dcp" in printed and "vs_static" in printed


def test_default_cap_is_the_longest_document_and_explicit_cap_splits_when_asked():
    config = SimulationConfig(lengths="builtin:prolong", tokens_per_step=1 << 20, steps=4, seed=2)
    batches, cap = cut_batches(config)
    assert cap == max(n for b in batches for _, n in b.sequences)
    split, cap2 = cut_batches(SimulationConfig(lengths="builtin:prolong", tokens_per_step=1 << 20, steps=4,
                                               seed=2, max_seq_len=4096, overlong="split"))
    assert cap2 == 4096 and max(b.max_length for b in split) <= 4096


def test_summary_definitions():
    def run(name, times):
        r = PolicyRun(name=name, mem_bytes_per_gpu=100)
        for t in times:
            r.add_step(step_time_s=t, lower_bound_s=1.0, num_tokens=10, plan_s=0.001, plan=StepPlan(1, ()))
        return r

    runs = {"static": run("static", [4.0, 2.0]), "megatron-hybrid": run("megatron-hybrid", [2.0, 3.0]),
            "dcp": run("dcp", [2.0, 1.0])}
    report = summarize(runs)
    # dcp against the per-step best baseline: (2 + 2) / (2 + 1)
    assert report["dcp"]["speedup_vs_best_baseline"] == pytest.approx(4.0 / 3.0)
    assert report["dcp"]["min_step_speedup_vs_best_baseline"] == pytest.approx(1.0)
    # a baseline against the best of the OTHER baselines only
    assert report["static"]["speedup_vs_best_baseline"] == pytest.approx(5.0 / 6.0)
    assert report["megatron-hybrid"]["speedup_vs_static"] == pytest.approx(6.0 / 5.0)
    assert report["dcp"]["tokens_per_s"] == pytest.approx(20 / 3.0)
    assert "dcp" in format_table(report)


@pytest.mark.parametrize("extra, fragment", [
    (["--gpus", "0"], "--gpus must be a positive integer"),
    (["--policies", "static,fastest"], "unknown policy 'fastest'"),
    (["--policies", "dcp,dcp"], "twice"),
    (["--tp", "3"], "not divisible by tp*pp"),
    (["--model", "llama9"], "unknown model preset 'llama9'"),
    (["--cluster", "tpu"], "unknown cluster preset 'tpu'"),
    (["--max-seq-len", "200000"], "--max-seq-len must be in"),
    (["--max-seq-len", "1000"], "--overlong split|truncate"),
])
def test_bad_arguments_exit_non_zero_with_a_clear_message(extra, fragment, capsys):
    assert main(["--lengths", "builtin:wikipedia", *SMALL, *extra]) == 2
    assert fragment in capsys.readouterr().err


def test_bad_lengths_inputs(tmp_path, capsys):
    bad = tmp_path / "bad.txt"
    bad.write_text("10\n20\nthirty\n")
    assert main(["--lengths", str(bad), *SMALL]) == 2
    assert "bad.txt:3" in capsys.readouterr().err
    assert main(["--lengths", "builtin:zipf", *SMALL]) == 2
    assert "unknown built-in length distribution 'zipf'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(SMALL)                                   # --lengths is required
    assert exit_info.value.code == 2


def test_megatron_dynamic_against_dcp(tmp_path, capsys):
    """`--policies megatron-dynamic,dcp`: the peer runs through the simulator and dcp never loses to it."""
    assert main(["--lengths", "builtin:prolong", *SMALL, "--policies", "megatron-dynamic,dcp",
                 "--json", str(tmp_path / "r.json")]) == 0
    report = json.loads((tmp_path / "r.json").read_text())["policies"]
    assert set(report) == {"megatron-dynamic", "dcp"}
    assert report["dcp"]["mean_step_s"] <= report["megatron-dynamic"]["mean_step_s"]
    assert report["megatron-dynamic"]["lb_ratio_p50"] >= 1.0 - 1e-9
    assert "| megatron-dynamic" in capsys.readouterr().out


def test_ablate_peer_refuses_a_zero_length_in_one_line_as_dcp_simulate_does(tmp_path, capsys):
    lengths = tmp_path / "zero.txt"
    lengths.write_text("100\n0\n200\n")
    assert main(["--lengths", str(lengths), *SMALL]) == 2
    simulate_err = capsys.readouterr().err
    assert load_tool("ablate_peer").main(["--lengths", str(lengths), "--domains", "4", "--steps", "1"]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [simulate_err.strip().replace("dcp-simulate:", "ablate_peer:")]
    assert "zero.txt:2" in captured.err and captured.out == ""   # refused before any sweep printed a row


def test_sweeps_print_their_winner_and_the_grid_only_with_verbose(tmp_path, capsys):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in [300, 12000, 40, 900, 65000, 7, 2048] * 6) + "\n")
    argv = ["--lengths", str(lengths), *SMALL, "--policies", "static,megatron-hybrid,dcp"]
    assert main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    winners = [line for line in printed if " run-wide settings over " in line]
    assert [line.split(":")[0] for line in winners] == ["static", "megatron-hybrid"]
    assert all("winner " in line for line in winners)
    assert not [line for line in printed if line.startswith("  ")]           # no grid point
    assert main(argv + ["--verbose"]) == 0
    grid = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert len([line for line in grid if line.startswith("  * ")]) == 2 and len(grid) > 4   # every point, winners starred


def test_dcp_is_never_slower_than_a_tuned_baseline_on_any_step():
    """5 GPUs, Wikipedia-like: the tuned megatron-hybrid (and megatron-dynamic) beat dcp's own plan and every
    baseline's default on a step (by 1.2% and 0.3%); dcp seeds from the run's tuned settings too, so it keeps up."""
    config = SimulationConfig(lengths="builtin:wikipedia", gpus=5, tokens_per_step=262144, steps=3, seed=0,
                              policies=("megatron-hybrid", "megatron-dynamic", "dcp"))
    result, _ = simulate(config)
    dcp = result.runs["dcp"].step_time_s
    for name in ("megatron-hybrid", "megatron-dynamic"):
        assert all(d <= b * (1 + 1e-9) for d, b in zip(dcp, result.runs[name].step_time_s)), name


def test_baseline_settings_are_for_dcp_and_of_each_baselines_kind():
    from dcp_megatron.planner.costmodel import CostModel, cluster_preset, model_preset
    from dcp_megatron.planner.plan import NO_RECOMPUTE
    from dcp_megatron.planner.policies import make_plan
    from dcp_megatron.planner.baselines.settings import DynamicSetting, StaticSetting

    cost = CostModel(model_preset("llama3-8b"), cluster_preset("h200", domain_size=4))
    batch = [(0, 4096), (1, 2048)]
    static = StaticSetting(cp_size=1, recompute=NO_RECOMPUTE)
    with pytest.raises(ValueError, match="baseline_settings are for policy 'dcp'"):
        make_plan("static", batch, cost, max_seq_len=4096, baseline_settings={"static": static})
    with pytest.raises(ValueError, match=r"baseline_settings\['megatron-hybrid'\]"):
        make_plan("dcp", batch, cost, max_seq_len=4096, baseline_settings={"megatron-hybrid": static})
    hybrid = DynamicSetting(token_cap=4096, recompute=NO_RECOMPUTE)
    assert make_plan("dcp", batch, cost, max_seq_len=4096, baseline_settings={"megatron-hybrid": hybrid,
                                                                               "static": static}).policy == "dcp"
