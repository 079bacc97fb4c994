"""GPT pretraining on megatron-core over variable-length, packed documents.

    torchrun --nproc-per-node 2 pretrain_scripts/pretrain_gpt.py --mock-data \
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 256 \
        --tokens-per-step 2048 --train-iters 10 --lr 1e-3

The recipe reads top to bottom: flags -> distributed start-up -> parallel state -> model
(GPTModel, local spec with our packed core attention) -> DDP -> optimizer -> LR schedule ->
data -> checkpoint load -> train loop -> save. Runs on CPU (gloo, fp32, CPU shims applied)
and on GPU (NCCL). Loss is per token over the global batch; global batches depend only on
the data, the seed and --tokens-per-step, never on the parallel layout.
"""
from __future__ import annotations

import os
import sys
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from dcp_megatron.megatron.arguments import parse_args  # noqa: E402
from dcp_megatron.megatron.compat import cpu_compat_registry  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    # 1. Flags, checked against each other and the machine before any work.
    has_gpu = torch.cuda.is_available()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args = parse_args(argv, world_size=world_size, has_gpu=has_gpu)

    # 2. CPU shims (nothing on a GPU machine), applied before megatron-core builds anything.
    cpu_compat = cpu_compat_registry().apply()

    from megatron.core import parallel_state, tensor_parallel

    from dcp_megatron.megatron import checkpoint, model_setup
    from dcp_megatron.megatron.microbatches import assemble_microbatch, static_dp_microbatches
    from dcp_megatron.megatron.mock_documents import MockDocuments
    from dcp_megatron.megatron.train_step import format_log_line, train_step
    from dcp_megatron.planner.batcher import GlobalBatcher

    # 3. Distributed start-up and Megatron's parallel state (TP x PP x CP x DP).
    if has_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.distributed.init_process_group(backend="nccl" if has_gpu else "gloo", timeout=timedelta(minutes=5))
    rank = torch.distributed.get_rank()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
    )
    torch.manual_seed(args.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    dp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
    dp_size = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    is_logging_rank = rank == 0

    # 4. Model, DDP, optimizer, LR schedule.
    config = model_setup.transformer_config(args)
    model = model_setup.build_model(args, config)
    model = model_setup.wrap_ddp(model, config)
    optimizer = model_setup.build_optimizer(args, model)
    lr_schedule = model_setup.build_lr_schedule(args, optimizer)

    # 5. Data: documents -> token-budget global batches (layout-independent) -> this rank's micro-batches.
    if args.data_path is not None:
        raise ValueError("--data-path needs the indexed-document reader (dcp_megatron/megatron/indexed_documents.py), "
                         "which is not available yet; use --mock-data")
    documents = MockDocuments(seed=args.seed, vocab_size=args.vocab_size, max_positions=args.seq_length)
    batcher = GlobalBatcher(tokens_per_step=args.tokens_per_step, max_seq_len=args.seq_length)
    pad_to = args.tensor_model_parallel_size if args.sequence_parallel else 1

    # 6. Resume.
    iteration, consumed_batches = 0, 0
    if args.load is not None:
        iteration, consumed_batches = checkpoint.load_checkpoint(
            args.load, args=args, model=model, optimizer=optimizer, lr_schedule=lr_schedule)
        if is_logging_rank:
            print(f"loaded checkpoint from {args.load} at iteration {iteration}", flush=True)
    global_batches = batcher.batches(documents.planned_lengths())
    for _ in range(consumed_batches):
        next(global_batches)

    tensorboard = None
    if args.tensorboard_dir is not None and is_logging_rank:
        from torch.utils.tensorboard import SummaryWriter
        tensorboard = SummaryWriter(log_dir=args.tensorboard_dir)

    # 7. Train.
    model.train()
    consumed_tokens = 0
    while iteration < args.train_iters:
        batch = next(global_batches)
        sources = static_dp_microbatches(batch.sources, dp_size=dp_size, dp_rank=dp_rank,
                                         tokens_per_microbatch=args.seq_length)
        microbatches = [assemble_microbatch(mb, documents.tokens, pad_to_multiple=pad_to) for mb in sources]
        lr = optimizer.param_groups[0]["lr"]  # the rate this step uses (the schedule advances in train_step)
        result = train_step(microbatches, model=model, optimizer=optimizer, lr_schedule=lr_schedule)
        iteration += 1
        consumed_batches += 1
        consumed_tokens += result.num_tokens
        if is_logging_rank and iteration % args.log_interval == 0:
            print(format_log_line(iteration, args.train_iters, result, lr=lr, consumed_tokens=consumed_tokens),
                  flush=True)
        if tensorboard is not None:
            tensorboard.add_scalar("lm loss", result.loss, iteration)
            tensorboard.add_scalar("tokens/s", result.num_tokens / result.step_time_s, iteration)
            tensorboard.add_scalar("learning rate", lr, iteration)
        if args.save is not None and args.save_interval is not None and iteration % args.save_interval == 0:
            checkpoint.save_checkpoint(args.save, iteration=iteration, consumed_batches=consumed_batches, args=args,
                                       model=model, optimizer=optimizer, lr_schedule=lr_schedule)

    # 8. Save and shut down.
    if args.save is not None:
        checkpoint.save_checkpoint(args.save, iteration=iteration, consumed_batches=consumed_batches, args=args,
                                   model=model, optimizer=optimizer, lr_schedule=lr_schedule)
    if tensorboard is not None:
        tensorboard.close()
    torch.distributed.barrier()
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    cpu_compat.remove()


if __name__ == "__main__":
    try:
        main()
    except ValueError as err:
        # User mistakes (flags, data, checkpoints): one clear line, no traceback.
        print(f"pretrain_gpt.py: error: {err}", file=sys.stderr)
        sys.exit(2)
