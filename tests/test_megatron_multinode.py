"""Multi-node `--dcp` on one machine: two torchrun agents on localhost (`--nnodes 2`, one rank each).

The planner then sees one rank per node (LOCAL_WORLD_SIZE 1), so every CP group of 2 crosses
nodes in its cost model; plans may differ from the single-node run's, the loss trace may not.
"""
from __future__ import annotations

import subprocess

import pytest

from tests.dist_utils import free_port
from tests.megatron_runs import CPU_FLAGS, LLAMA_TINY, OUR_SCRIPT, REPO, parse_output, run_env, run_training, \
    torchrun_command

pytestmark = pytest.mark.timeout(900)
FLAGS = [*LLAMA_TINY, *CPU_FLAGS, "--train-iters", "6", "--dcp", "--dcp-memory-budget-gb", "0.004"]


def test_two_torchrun_agents_match_the_single_node_trace():
    port = free_port()
    agents = [subprocess.Popen(torchrun_command(OUR_SCRIPT, FLAGS, nproc=1, launcher=False, port=port, nnodes=2,
                                                node_rank=node), cwd=REPO, env=run_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
    outputs = []
    for agent in agents:
        out, _ = agent.communicate(timeout=600)
        outputs.append(parse_output(agent.returncode, out))
    for result in outputs:
        result.check()
    # Megatron prints iteration lines on the last rank (node 1), DCP its plan lines on rank 0 (node 0).
    multi = parse_output(0, outputs[0].output + outputs[1].output)
    single = run_training(OUR_SCRIPT, FLAGS[len(LLAMA_TINY) + len(CPU_FLAGS) + 2:], iters=6).check()
    assert len(multi.losses) == 6 and multi.dcp_steps, multi.output[-3000:]
    worst = max(abs(multi.losses[i] - single.losses[i]) / abs(single.losses[i]) for i in single.losses)
    assert worst <= 1e-5, (multi.loss_trace(), single.loss_trace())
    assert any("cp2" in s["cp_sizes"] for s in multi.dcp_steps.values())
