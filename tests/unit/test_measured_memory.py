"""Each micro-batch's memory read by the engine step (the DeepSpeed adapter's), and one MAX all-reduce that gives
every rank the same corrected count: 2 gloo ranks whose counts are low by different factors."""
import contextlib
from types import SimpleNamespace

import pytest
import torch

from tests.support.dist_utils import run_distributed

HIDDEN = 16


class _Tiny(torch.nn.Module):
    """A module the engine step can switch recompute on (a decoder with no layers) around one linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList()
        self.decoder.config = SimpleNamespace()
        self.linear = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(rows)).square().sum()


def _rank(rank: int, world: int):
    from dcp_megatron.core.microbatch_facts import MICROBATCH_KEY
    from dcp_megatron.deepspeed.engine_step import run_planned_step
    from dcp_megatron.planner.costmodel.memory_correction import MemoryCorrection, MemoryReading
    from dcp_megatron.planner.plan import NO_RECOMPUTE
    from dcp_megatron.runtime.measured_memory import SavedReadings, fold_readings

    torch.manual_seed(0)
    model = _Tiny()
    engine = SimpleNamespace(module=model, zero_optimization_stage=lambda: 0, no_sync=contextlib.nullcontext,
                             backward=lambda loss, scale_wrt_gas: loss.backward(), step=lambda: None,
                             get_global_grad_norm=lambda: None)
    rows = [8, 32] if rank == 0 else [64]          # rank 1's micro-batch saves the most
    batches = [{"rows": torch.randn(n, HIDDEN),
                MICROBATCH_KEY: SimpleNamespace(recompute=NO_RECOMPUTE, cp_size=1)} for n in rows]
    memory = SavedReadings(model.parameters())
    outcome = run_planned_step(engine, batches, forward_loss=lambda e, b: (e.module(b["rows"]), b["rows"].shape[0]),
                               num_tokens=8 + 32 + 64,
                               world_size=world, memory=memory)
    # the linear saves its input (n x 16 fp32), tanh its output, square its input (the same storage: once)
    expected = [2 * n * HIDDEN * 4 for n in rows]
    correction = MemoryCorrection()
    counted = 2 * HIDDEN * 4 / (1.5 if rank == 0 else 2.0)   # per row: low by 1.5x here, 2x on rank 1
    scale = fold_readings(correction, [MemoryReading("none", counted * n, measured)
                                       for n, measured in zip(rows, outcome.memory_bytes)], ["none"], device="cpu")
    return list(outcome.memory_bytes), expected, dict(scale.factors)


def test_the_engine_step_reads_each_micro_batch_and_every_rank_folds_the_worst():
    results = run_distributed(_rank, 2)
    for measured, expected, _ in results:
        assert measured == expected
    factors = [factors for _, _, factors in results]
    assert factors[0] == factors[1] == {"none": pytest.approx(2.0 * 1.05)}     # the worst rank's, on both
