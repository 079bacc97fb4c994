"""tools/demo.py's three interleaved runs, its report, and its tuned megatron-dynamic (no training, no timing asserts).

The interleaving runs three stand-in processes that print Megatron's iteration lines; the report is fed
PausedRuns filled by hand; the tuning reads the demo's global batches through Megatron's dataset (one process).
"""
import argparse
import importlib.util
import json
import os
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(ROOT, "tools")


def _tool(name):
    if TOOLS not in sys.path:
        sys.path.insert(0, TOOLS)   # demo.py imports its sibling tools by name
    spec = importlib.util.spec_from_file_location(name, os.path.join(TOOLS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module   # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


FAKE_RUN = """
import sys, time
for it in range(1, int(sys.argv[1]) + 1):
    time.sleep(0.3)   # well above the pause's latency on a loaded machine (SIGSTOP after the line is read)
    print(f" dcp iteration {it:4d} | plan x: waves 1 | cp sizes [2] | micro-batches/rank [1] | recompute none | "
          f"predicted (ms): {10 + it}.0 | forward-backward (ms): 1.0", flush=True)
    print(f" [2026] iteration {it:8d}/{sys.argv[1]:>8s} | elapsed time per iteration (ms): {50 + it}.0 | "
          f"lm loss: {1 / it:.6E} |", flush=True)
"""


def test_three_runs_take_turns_in_blocks_on_the_same_steps(tmp_path):
    demo, interleave = _tool("demo"), _tool("demo_interleave")
    script = tmp_path / "fake_run.py"
    script.write_text(FAKE_RUN)
    steps, block = 8, 3
    runs = [interleave.PausedRun(label=label, cmd=[sys.executable, str(script), str(steps)], env=dict(os.environ),
                                 cwd=str(tmp_path), parse_iteration=demo._iteration, parse_plan=demo._plan)
            for label in ("dcp", "static", "tuned")]
    interleave.alternate(runs, total_steps=steps, block=block)
    for run in runs:
        assert sorted(run.steps) == list(range(1, steps + 1)), run.tail
        assert run.steps[3].ms == 53.0 and run.steps[3].predicted_ms == 13.0 and "waves 1" in run.steps[3].plan
        assert len(run.pauses) >= 3            # resumed for the blocks 2-4, 5-7, 8 (and at the end)
    # Every block ends in one run before the next run's block starts: steps 1 | 2-4 | 5-7 | 8, in turn.
    for first, last in ((1, 1), (2, 4), (5, 7), (8, 8)):
        for a, b in zip(runs, runs[1:]):
            assert a.steps[last].arrived_s < b.steps[first].arrived_s
    # The first step of a block spans the pause before it: measured in no run. (A step the process printed before
    # its SIGSTOP landed makes the next one span the pause too, so on a loaded machine fewer steps may be clean.)
    common = interleave.common_steps(runs, skip=0)
    assert common and set(common) <= {3, 4, 6, 7}, common
    ratio, per_block = interleave.block_ratios(runs[0], runs[2], steps=common, block=block)
    assert ratio == 1.0 and per_block and all(r == 1.0 for r in per_block)


def _run(interleave, label, ms, losses):
    run = interleave.PausedRun(label=label, cmd=[], env={}, cwd="", parse_iteration=None, parse_plan=None)
    run.steps = {i + 1: interleave.Step(ms=m, loss=loss, arrived_s=float(i)) for i, (m, loss) in
                 enumerate(zip(ms, losses))}
    return run


def test_the_report_compares_dcp_with_static_and_the_tuned_baseline(capsys):
    demo, interleave = _tool("demo"), _tool("demo_interleave")
    losses = [3.0, 2.5, 2.0, 1.5, 1.2, 1.0]
    runs = [_run(interleave, "dcp", [100.0] * 6, losses), _run(interleave, "static", [200.0] * 6, losses),
            _run(interleave, "tuned", [150.0] * 6, [x * (1 + 1e-7) for x in losses])]
    unrefined = {"dcp": {i: 90.0 for i in range(1, 7)}, "static": {i: 270.0 for i in range(1, 7)},
                 "tuned": {i: 180.0 for i in range(1, 7)}}
    args = argparse.Namespace(steps=6, warmup_steps=1, block=2, global_batch_size=4, seq_length=2048)
    assert demo.report(runs, unrefined, args, (1.0,), (2.0,))
    out = capsys.readouterr().out
    assert "the 3 runs alternate" in out and "5 steps measured cleanly in all" in out
    assert "DCP / static = 2.00x measured" in out and "predicted 3.00x" in out
    assert "DCP / tuned megatron-dynamic = 1.50x measured" in out and "predicted 2.00x" in out
    assert "tuned megatron-dynamic" in out and "81920 tokens/s measured" in out   # 4 x 2048 / 0.1 s
    assert "loss columns equal" in out
    runs[2].steps[4].loss = 9.0   # one run's loss column differs
    assert not demo.report(runs, unrefined, args, (1.0,), (2.0,))
    assert "DIFFER" in capsys.readouterr().out


def test_tuning_reads_the_runs_batches_and_gives_a_setting_the_tuned_run_accepts(tmp_path):
    demo, tuning = _tool("demo"), _tool("demo_tuning")
    from dcp_megatron.flags.dcp_flags import policy_setting_from_flag
    from dcp_megatron.planner.baselines.settings import DynamicSetting

    prefix = str(tmp_path / "stdlib")
    demo.build_dataset(prefix, 4)
    args = argparse.Namespace(seq_length=512, global_batch_size=4, steps=3)
    budget = ["--dcp-memory-budget-gb", "0.033", "--dcp-no-refine"]
    flags = demo.training_flags(prefix, args, ["--dcp", "--dcp-policy", "megatron-dynamic", *budget])
    batches = tuning.demo_batches(tuning.run_args(flags))
    assert len(batches) == 3
    for batch in batches:   # 4 samples of 512 tokens, cut into documents, ids in order
        assert sum(n for _, n in batch) == 4 * 512 and [i for i, _ in batch] == list(range(len(batch)))
    result, setting = tuning.tune_megatron_dynamic(flags)
    assert result.num_batches == 3 and len(result.points) > 1
    assert policy_setting_from_flag(setting, "megatron-dynamic") == result.winner
    assert isinstance(result.winner, DynamicSetting)
    labels = [label for label, _ in demo.run_flags(budget, setting)]
    assert labels == ["dcp", "static", "tuned"]
    tuned = dict(demo.run_flags(budget, setting))["tuned"]
    assert tuned[tuned.index("--dcp-policy-setting") + 1] == setting and json.loads(setting)["token_cap"] > 0
