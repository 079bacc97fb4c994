"""bench_runtime's planning half (no training): the cost model's view it prints next to the
measured ratios, the memory flag, and its input checks. The measured half runs in tools/ only."""
import json
import re

import pytest

from tests.support.tool_helpers import load_tool

bench = load_tool("bench_runtime")


def test_predict_only_prints_predicted_ratio_below_its_ceiling(capsys):
    assert bench.main(["--predict-only", "--steps", "3", "--tokens-per-step", "8192"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "40 MiB per rank, cap 4096 tokens" in lines[0]
    for kind in ("longtail", "uniform"):
        line = next(x for x in lines if x.startswith(f"predicted ratio_{kind}="))
        predicted, ceiling, predicted_median, ceiling_median = (float(x) for x in re.findall(r"\d+\.\d+", line))
        # every dcp estimate is at least the lower bound, so summed (and per batch) static/dcp <= static/bound
        assert 0.99 <= predicted <= ceiling + 1e-9
        assert 0.99 <= predicted_median <= ceiling_median + 1e-9
    assert "static layout: CP=2 for every sequence" in "\n".join(lines)


def test_memory_budget_flag_sets_the_cap(capsys):
    assert bench.main(["--predict-only", "--steps", "1", "--max-seq-len", "1000000", "--tokens-per-step", "65536"]) == 0
    assert bench.main(["--predict-only", "--steps", "1", "--max-seq-len", "1000000", "--tokens-per-step", "65536",
                       "--mem-per-rank-mib", "80"]) == 0
    caps = [int(line.split(", cap ")[1].split()[0]) for line in capsys.readouterr().out.splitlines() if ", cap " in line]
    cost = bench.CostModel(bench.model_preset("gpt-tiny"), bench.cpu_cluster(2))
    # the cap is the longest document the 2-rank domain holds with the strongest recompute, so it grows with memory
    assert caps[0] == bench.memory_cap(cost, 65536) and 1.5 * caps[0] < caps[1] < 65536


def test_both_policies_plan_every_batch_and_dcp_never_loses():
    cost = bench.CostModel(bench.model_preset("gpt-tiny"), bench.cpu_cluster(2))
    cap = bench.memory_cap(cost, 4096)
    args = bench.argparse.Namespace(tokens_per_step=8192, steps=2, seed=0, max_seq_len=4096)
    plans = bench.make_plans(bench.make_batches(args, cap), cost, cap)
    assert set(plans) == {"longtail", "uniform"} and len(plans["longtail"]) == 3
    for steps in plans.values():
        for by_policy in steps:
            assert set(by_policy) == {"static", "dcp"}
            assert by_policy["dcp"].est_step_time_s <= by_policy["static"].est_step_time_s * (1 + 1e-12)
    ratios = bench.predicted_ratios(plans)
    assert ratios["ratio_uniform_predicted"] == pytest.approx(1.0, abs=0.01)
    for kind in ("longtail", "uniform"):
        for suffix in ("", "_median"):
            assert ratios[f"ratio_{kind}_predicted{suffix}"] <= ratios[f"ratio_{kind}_ceiling{suffix}"] + 1e-12


def test_bad_arguments_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--predict-only", "--mem-per-rank-mib", "0"])
    with pytest.raises(SystemExit):   # positive, but smaller than the model's own state
        bench.main(["--predict-only", "--mem-per-rank-mib", "8"])
    assert "holds no document at all" in capsys.readouterr().err


def test_headroom_sweep_reports_the_largest_ceiling_among_static_cp2_regimes(capsys, tmp_path):
    headroom = load_tool("runtime_headroom")
    out = tmp_path / "rows.json"
    # 32 MiB with a 2,048 cap holds a cap-length document on one rank (static CP=1); the others need CP=2
    assert headroom.main(["--mem-per-rank-mib", "32,40", "--max-seq-len", "2048,4096", "--tokens-per-step", "8192",
                          "--steps", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert len(rows) == 4 and {r["static_cp_size"] for r in rows} == {1, 2}
    for row in rows:
        assert 0.99 <= row["predicted"] <= row["ceiling"] + 1e-9
    best = max(r["ceiling"] for r in rows if r["static_cp_size"] == 2)
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == f"max_ceiling={best:.4f}"


def test_headroom_refuses_an_empty_grid_and_reports_budgets_that_hold_nothing(capsys):
    headroom = load_tool("runtime_headroom")
    with pytest.raises(SystemExit):
        headroom.main(["--tokens-per-step", ""])
    assert headroom.main(["--mem-per-rank-mib", "8", "--max-seq-len", "4096", "--tokens-per-step", "8192"]) == 0
    out = capsys.readouterr().out
    assert "no plan: 8 MiB per rank holds no document at all" in out and "no regime in the grid" in out
