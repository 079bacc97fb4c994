"""The micro-batch count of the step planned ahead follows Megatron's batch-size schedule (issue 21, Bad 2):
Megatron's own calculator stepped through a run as train() steps it, against our one-step-early answer."""
from __future__ import annotations

import argparse

import pytest

pytest.importorskip("megatron.core")

from megatron.core import num_microbatches_calculator as calculators  # noqa: E402
from megatron.core import parallel_state  # noqa: E402

import megatron.training  # noqa: E402
from dcp_megatron.training.batch_schedule import next_step_num_microbatches  # noqa: E402


@pytest.mark.parametrize("schedule, data_parallel_size, micro_batch_size", [
    ("0:4 16:8", 2, 1),            # grows after 4 steps of 4 samples
    ("0:8 24:16 40:4", 4, 1),      # grows, then shrinks
    ("0:8 8:24", 2, 2),            # grows after the first step, micro-batches of 2
])
def test_next_steps_count_is_megatrons_count_at_that_step(monkeypatch, schedule, data_parallel_size,
                                                         micro_batch_size):
    args = argparse.Namespace(consumed_train_samples=0, micro_batch_size=micro_batch_size)
    monkeypatch.setattr(megatron.training, "get_args", lambda: args)
    monkeypatch.setattr(parallel_state, "get_data_parallel_world_size", lambda: data_parallel_size)
    calculators.destroy_num_microbatches_calculator()
    calculators.init_num_microbatches_calculator(rank=1, micro_batch_size=micro_batch_size,
                                                 data_parallel_size=data_parallel_size,
                                                 step_batch_size_schedule=schedule)
    try:
        counts, predicted = [], []
        for _ in range(12):   # what train() does around each step
            calculators.update_num_microbatches(args.consumed_train_samples, consistency_check=True)
            count = calculators.get_num_microbatches()
            counts.append(count)
            predicted.append(next_step_num_microbatches(count))
            assert calculators.get_num_microbatches() == count   # Megatron's own calculator is left alone
            args.consumed_train_samples += data_parallel_size * micro_batch_size * count
        assert len(set(counts)) > 1, counts
        assert predicted[:-1] == counts[1:]
    finally:
        calculators.destroy_num_microbatches_calculator()
