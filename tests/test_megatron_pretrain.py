"""End-to-end runs of pretrain_scripts/pretrain_gpt.py under torchrun (gloo, CPU, fp32).

Global batches depend only on the data, the seed and the token budget, and weights only on
the seed, so every layout must produce the loss trace of a single process: --dcp on 2 ranks
(with a memory budget small enough that long documents need CP 2 or recompute, so plans mix
CP sizes and recompute settings), Megatron's static CP=2 with selective recompute, DCP with
TP=2 + sequence parallelism (4 ranks) and DCP with PP=2 (4 ranks). A --dcp run resumed from a
checkpoint continues its trace exactly. Each launch costs ~15-30 s here, so there are few.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "pretrain_scripts" / "pretrain_gpt.py"
ITERS = 10
MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--num-query-groups", "2", "--swiglu", "--untie-embeddings-and-output-weights", "--seq-length", "512",
         "--tokens-per-step", "2048", "--lr-decay-iters", str(ITERS), "--lr", "2e-3", "--lr-warmup-iters", "1",
         "--seed", "11"]
MOCK = ["--mock-data", *MODEL]
# Budgets (GiB per rank) under which the cpu cost model needs CP 2 / recompute for long documents.
DCP_2 = ["--dcp", "--dcp-memory-budget-gb", "0.0054"]
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*\| lm loss: (\d\.\d{6}E[+-]\d\d) \|")
CP_SIZES = re.compile(r"iteration\s+(\d+)/.*\| cp sizes (\S+) \|")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT))


def _run(num_ranks: int, *args: str, iters: int = ITERS) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(num_ranks),
           "--master-port", str(_free_port()), str(SCRIPT), *args, "--train-iters", str(iters)]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


def _losses(stdout: str) -> dict[int, float]:
    losses = {int(it): float(loss) for it, loss in LOSS.findall(stdout)}
    assert losses, stdout[-3000:]
    return losses


def _assert_same_trace(got: dict[int, float], want: dict[int, float]) -> None:
    assert sorted(got) == sorted(want)
    for it in want:
        assert abs(got[it] - want[it]) <= 1e-5 * abs(want[it]), f"iteration {it}: {got[it]} vs {want[it]}"


@pytest.fixture(scope="module")
def single_process_trace() -> dict[int, float]:
    losses = _losses(_run(1, *MOCK))
    assert sorted(losses) == list(range(1, ITERS + 1))
    return losses


def test_dcp_matches_single_process_mixes_cp_sizes_dumps_plans_and_resumes(single_process_trace, tmp_path):
    checkpoints, plans = tmp_path / "ckpt", tmp_path / "plans"
    out = _run(2, *MOCK, *DCP_2, "--save", str(checkpoints), "--save-interval", "5", "--dcp-dump-plans", str(plans),
               "--dcp-check-plans")
    _assert_same_trace(_losses(out), single_process_trace)
    # The dynamic path ran: plans differ between steps and mix CP sizes 1 and 2 within steps.
    cp_sizes = dict(CP_SIZES.findall(out))
    assert len(cp_sizes) == ITERS and len(set(cp_sizes.values())) > 1, cp_sizes
    assert any("cp1" in h and "cp2" in h for h in cp_sizes.values()), cp_sizes
    assert "plan dcp:" in out and "recompute full" in out
    step = json.loads((plans / "step_0000001.json").read_text())
    assert step["domain_size"] == 2 and step["policy"] == "dcp"
    assert {g["size"] for w in step["waves"] for g in w["groups"]} <= {1, 2}
    assert (plans / f"step_{ITERS:07d}.png").stat().st_size > 1000
    # Resume from iteration 5 (model, optimizer, schedule and data position).
    (checkpoints / "latest_checkpointed_iteration.txt").write_text("5\n")
    resumed = _losses(_run(2, *MOCK, *DCP_2, "--load", str(checkpoints)))
    _assert_same_trace(resumed, {it: single_process_trace[it] for it in range(6, ITERS + 1)})


def test_static_cp2_with_selective_recompute_matches_single_process(single_process_trace):
    out = _run(2, *MOCK, "--context-parallel-size", "2", "--recompute-granularity", "selective")
    _assert_same_trace(_losses(out), single_process_trace)
    assert set(dict(CP_SIZES.findall(out)).values()) <= {f"cp2x{n}" for n in range(1, 100)}
    assert "plan megatron-static-cp2:" in out and "recompute selectivex" in out


def test_dcp_with_tensor_parallel_and_sequence_parallel_matches(single_process_trace):
    out = _run(4, *MOCK, "--dcp", "--dcp-memory-budget-gb", "0.003", "--tensor-model-parallel-size", "2",
               "--sequence-parallel", iters=6)
    _assert_same_trace(_losses(out), {it: single_process_trace[it] for it in range(1, 7)})
    assert any("cp2" in h for h in dict(CP_SIZES.findall(out)).values())


def test_dcp_with_pipeline_parallel_matches(single_process_trace):
    out = _run(4, *MOCK, "--dcp", "--dcp-memory-budget-gb", "0.0035", "--pipeline-model-parallel-size", "2",
               iters=6)
    _assert_same_trace(_losses(out), {it: single_process_trace[it] for it in range(1, 7)})
    assert any("cp2" in h for h in dict(CP_SIZES.findall(out)).values())


def test_data_path_with_the_demo_dataset_trains(tmp_path):
    prefix = tmp_path / "stdlib"
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_demo_data.py"), "--output-prefix", str(prefix),
                    "--max-files", "30", "--max-document-tokens", "513"], cwd=ROOT, env=_env(), check=True,
                   capture_output=True, timeout=300)
    args = [a for a in MODEL] + ["--data-path", str(prefix), "--vocab-size", "257", "--lr", "1e-2"]
    losses = _losses(_run(2, *args, *DCP_2, iters=6))
    assert losses[6] < losses[1] - 0.5   # real text: the loss falls fast from ln(vocab)


def _fails(*args: str) -> str:
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return proc.stderr.strip().splitlines()[-1]


def test_bad_flags_and_bad_data_exit_with_a_clear_message(tmp_path):
    line = _fails(*MOCK, "--train-iters", "2", "--dcp", "--dcp-max-cp-size", "4")
    assert line.startswith("pretrain_gpt.py: error: --dcp-max-cp-size 4 exceeds the DCP domain of 1 ranks")
    (tmp_path / "bad.bin").write_bytes(b"\0" * 64)
    (tmp_path / "bad.idx").write_bytes(b"not an index")
    line = _fails(*MODEL, "--train-iters", "2", "--data-path", str(tmp_path / "bad"), "--vocab-size", "257")
    assert line.startswith("pretrain_gpt.py: error:") and "bad.idx" in line
