"""The demo's tuned megatron-dynamic: its run-wide setting swept over the demo's own global batches.

A tuned user of Megatron dev's dynamic CP sets its knobs once for the run, as planner/baselines/sweep.py does in
the simulator. Here the sweep sees what the runs will plan: the global batches Megatron's dataset and sampler
deal for the demo's flags (built as the DeepSpeed script builds them, dcp_megatron/deepspeed/samples.py: the
same GPTDataset, seed and sample order), cut into documents in domain-rank order, and the cost model the
runtime builds from the same flags (core/planning.py: model shape, CPU cluster, --dcp-memory-budget-gb).
"""
from __future__ import annotations

import json


def run_args(flags: list[str]):
    """The runs' flags parsed by Megatron's parser with the --dcp group (no checks, no process group), with what
    Megatron's validate_args would fill in for the planner and the dataset."""
    from dcp_megatron.deepspeed.arguments import megatron_parser

    args = megatron_parser().parse_args([*flags, "--deepspeed-config", "unused.json"])
    args.kv_channels = args.kv_channels or args.hidden_size // args.num_attention_heads
    args.data_parallel_size = 2
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    args.padded_vocab_size = -(-args.vocab_size // multiple) * multiple
    return args


def demo_batches(args, *, domain_size: int = 2) -> list[list[tuple[int, int]]]:
    """Every step's global batch [(sequence_id, length)] as the runs plan it: rank 0's documents, then rank 1's."""
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    from dcp_megatron.deepspeed.samples import SampleShares, build_train_dataset

    dataset = build_train_dataset(args, build_tokenizer(args))
    shares = [SampleShares(dataset, global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size,
                           data_parallel_rank=rank, data_parallel_size=domain_size) for rank in range(domain_size)]
    batches = []
    for _ in range(args.train_iters):
        lengths = [n for share in shares for n in share.next_share().lengths]
        batches.append(list(enumerate(lengths)))
    return batches


def tune_megatron_dynamic(flags: list[str]):
    """(the sweep's SweepResult, the winner as --dcp-policy-setting JSON text) for the runs' `flags`."""
    import torch

    from dcp_megatron.core.planning import build_cost_model, model_shape_from_args
    from dcp_megatron.flags.dcp_flags import dcp_config_from_args
    from dcp_megatron.planner.baselines.sweep import sweep

    args = run_args(flags)
    config = dcp_config_from_args(args)
    cost = build_cost_model(config, model_shape_from_args(args), domain_size=2, has_gpu=torch.cuda.is_available())
    result = sweep("megatron-dynamic", demo_batches(args), cost, max_seq_len=args.seq_length)
    return result, json.dumps(result.winner.to_json())
