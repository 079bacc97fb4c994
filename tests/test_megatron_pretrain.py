"""End-to-end runs of pretrain_scripts/pretrain_gpt.py under torchrun (gloo, CPU, fp32).

Global batches depend only on the data, the seed and the token budget, and weights only on
the seed, so every layout must produce the same loss trace as a single process: DP=2,
TP=2 with sequence parallelism and selective recompute x DP=2, PP=2 x DP=2 (with full recompute). A run resumed from
a checkpoint continues that trace exactly. Each launch costs ~10-30 s here, so there are few.
"""
from __future__ import annotations

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
ITERS = 4
MODEL = ["--mock-data", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--num-query-groups", "2", "--swiglu", "--untie-embeddings-and-output-weights", "--seq-length", "128",
         "--tokens-per-step", "1024", "--train-iters", str(ITERS), "--lr-decay-iters", str(ITERS),
         "--lr", "2e-3", "--lr-warmup-iters", "1", "--seed", "11"]
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*\| lm loss: (\d\.\d{6}E[+-]\d\d) \|")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT))


def _launch(num_ranks: int, *extra: str) -> dict[int, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(num_ranks),
           "--master-port", str(_free_port()), str(SCRIPT), *MODEL, *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    losses = {int(it): float(loss) for it, loss in LOSS.findall(proc.stdout)}
    assert losses, proc.stdout[-3000:]
    return losses


def _assert_same_trace(got: dict[int, float], want: dict[int, float]) -> None:
    assert sorted(got) == sorted(want)
    for it in want:
        assert abs(got[it] - want[it]) <= 1e-5 * abs(want[it]), f"iteration {it}: {got[it]} vs {want[it]}"


@pytest.fixture(scope="module")
def single_process_trace() -> dict[int, float]:
    losses = _launch(1)
    assert sorted(losses) == list(range(1, ITERS + 1))
    assert losses[ITERS] < losses[1]  # it trains
    return losses


def test_data_parallel_run_and_resume_match_single_process(single_process_trace, tmp_path):
    _assert_same_trace(_launch(2, "--save", str(tmp_path), "--save-interval", "2"), single_process_trace)
    # Resume from iteration 2: point the tracker at that checkpoint and train to the end again.
    assert (tmp_path / "iter_0000002" / "mp_rank_00_000.pt").exists()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2\n")
    resumed = _launch(2, "--load", str(tmp_path))
    _assert_same_trace(resumed, {it: single_process_trace[it] for it in range(3, ITERS + 1)})


def test_tensor_parallel_with_sequence_parallel_and_selective_recompute_matches(single_process_trace):
    trace = _launch(4, "--tensor-model-parallel-size", "2", "--sequence-parallel", "--recompute-granularity", "selective")
    _assert_same_trace(trace, single_process_trace)


def test_pipeline_parallel_with_full_recompute_matches_single_process(single_process_trace):
    trace = _launch(4, "--pipeline-model-parallel-size", "2", "--recompute-granularity", "full")
    _assert_same_trace(trace, single_process_trace)


def test_bad_flags_exit_with_a_clear_message():
    proc = subprocess.run([sys.executable, str(SCRIPT), *MODEL, "--fp8-format", "hybrid"], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    if proc.returncode == 0:
        pytest.fail("--fp8-format was accepted")
    if "no GPU" not in proc.stderr:
        pytest.skip("a GPU is present: --fp8-format is valid here")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("pretrain_gpt.py: error: --fp8-format hybrid")
    assert "Traceback" not in proc.stderr
