"""Bad input and a dead rank on the megatron.training path: a clear error, exit status, no hang."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tests.dist_utils import free_port
from tests.megatron_runs import (CPU_FLAGS, LLAMA_TINY, OUR_SCRIPT, REPO, run_env, run_training, strip_dcp_lines,
                                torchrun_command)

pytestmark = pytest.mark.timeout(900)


@pytest.mark.parametrize("extra, message, launcher", [
    (["--dcp", "--context-parallel-size", "2"], "--context-parallel-size 2 conflicts with --dcp", True),
    (["--dcp", "--dcp-memory-budget-gb", "nan"], "--dcp-memory-budget-gb must be a positive number", False),
    (["--dcp-policy", "static"], "only take effect with --dcp", False),
    # This 1.3 MiB budget holds no 1,024-token document on 2 ranks: stopped before the first step, flags named.
    (["--dcp", "--dcp-memory-budget-gb", "0.0013", "--dcp-recompute", "none"],
     "fits no CP group of this 2-rank domain", True),
    # Upstream would train to the first save and fail there: refused before the model is built.
    (["--save", __file__, "--save-interval", "2"], "exists and is not a directory", True),
])
def test_bad_flags_stop_the_run_with_one_clear_line(extra, message, launcher, tmp_path):
    script = OUR_SCRIPT
    if launcher:  # the user's unmodified script: the launcher prints the error as one line and exits 2
        script = str(tmp_path / "user_pretrain_gpt.py")
        strip_dcp_lines(OUR_SCRIPT, script)
    run = run_training(script, extra, iters=3, timeout_s=300, launcher=launcher)
    assert run.returncode != 0
    assert message in run.output, run.output[-3000:]
    assert not run.losses, "nothing may train before a refused flag stops the run"
    if launcher:
        assert f"dcp_megatron.launch: error: " in run.output and "exitcode  : 2" in run.output


def test_a_dead_rank_ends_the_run_naming_it():
    flags = [*LLAMA_TINY, *CPU_FLAGS, "--train-iters", "200", "--dcp", "--dcp-memory-budget-gb", "0.004"]
    command = torchrun_command(OUR_SCRIPT, flags, nproc=2, launcher=False, port=free_port())
    agent = subprocess.Popen(command, cwd=REPO, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
    lines = []
    try:
        for line in agent.stdout:
            lines.append(line)
            if "iteration        2/" in line:
                break
        workers = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True).stdout.split()
        assert len(workers) == 2, workers
        victim = sorted(int(pid) for pid in workers)[1]
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        rest, _ = agent.communicate(timeout=240)
        elapsed = time.monotonic() - killed_at
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
    output = "".join(lines) + rest
    assert agent.returncode != 0
    assert elapsed < 180, f"the surviving rank took {elapsed:.0f} s to stop"
    # torchrun's failure report names the killed worker: its rank and its pid.
    assert f"pid: {victim}" in output and "rank      : 1 (local_rank: 1)" in output, output[-3000:]
