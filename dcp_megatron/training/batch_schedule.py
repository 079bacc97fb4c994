"""How many micro-batches Megatron's next training step will pull, known one step early.

Planning ahead reads step k+1's share of the global batch while step k trains. Megatron changes the
number of samples per step only at the start of a step (`update_num_microbatches(consumed_train_samples)`
in train(), for --step-batch-size-schedule; megatron-core 0.19 ignores --rampup-batch-size, which
flag_checks.py refuses), after our read-ahead ran: reading with step k's count trained the old batch size at the step
where it grows, and shifted every later step's data. The next count is the schedule's value at the
samples consumed once step k ends, asked of a copy of Megatron's calculator (the live one is left alone).
"""
from __future__ import annotations

import copy


def next_step_num_microbatches(num_microbatches: int) -> int:
    """The micro-batch count of the step after the one running now with `num_microbatches`."""
    from megatron.core import num_microbatches_calculator as calculators
    from megatron.core import parallel_state
    from megatron.training import get_args

    args = get_args()
    calculator = calculators._GLOBAL_NUM_MICROBATCHES_CALCULATOR
    # what train() adds to consumed_train_samples after this step (its _dp_world_size under DCP: CP is 1)
    consumed = (args.consumed_train_samples
                + parallel_state.get_data_parallel_world_size() * args.micro_batch_size * num_microbatches)
    probe = copy.copy(calculator)
    probe.update(consumed, consistency_check=False)
    return int(probe.get())
