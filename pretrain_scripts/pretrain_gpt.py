"""GPT pretraining on megatron-core over variable-length, packed documents, with DCP.

    torchrun --nproc-per-node 2 pretrain_scripts/pretrain_gpt.py --mock-data \
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 256 \
        --tokens-per-step 2048 --train-iters 10 --lr 1e-3 --dcp

The recipe reads top to bottom: flags -> data -> device and patches -> distributed start-up -> parallel state and
the DCP group pool -> model (GPTModel, local spec with our packed/CP core attention) -> DDP ->
optimizer -> LR schedule -> cost model -> checkpoint load -> train loop -> save.
Every step: plan the global batch (the same plan on every rank), run this rank's micro-batches
through Megatron's schedule, step the optimizer. Without --dcp the plan is Megatron's static
layout from the flags (--context-parallel-size C included), run by the same runtime.
Runs on CPU (gloo, fp32, CPU shims applied) and on GPU (NCCL; --bf16 with Transformer Engine
attention when installed, see tools/gpu_check.sh).
"""
from __future__ import annotations

import math
import os
import sys
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from dcp_megatron.megatron.arguments import parse_args  # noqa: E402
from dcp_megatron.megatron.patch_set import megatron_patch_registry  # noqa: E402

GROUP_TIMEOUT = timedelta(minutes=5)


def init_distributed(*, backend: str) -> None:
    """torchrun's env:// rendezvous; a plain `python pretrain_gpt.py` runs as a world of one."""
    if "RANK" in os.environ:
        torch.distributed.init_process_group(backend=backend, timeout=GROUP_TIMEOUT)
        return
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torch.distributed.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                         world_size=1, timeout=GROUP_TIMEOUT)


def main(argv: list[str] | None = None) -> None:
    # 1. Flags, checked against each other and the machine before any work.
    has_gpu = torch.cuda.is_available()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args = parse_args(argv, world_size=world_size, has_gpu=has_gpu)

    # 2. Data (layout-independent global batches): opened first, so bad data stops the run before any work.
    from dcp_megatron.megatron.data_source import batch_stream, open_documents

    documents = open_documents(args)
    stream = batch_stream(args, documents)

    # 3. This rank's device, then the patches to megatron-core (version-checked), applied before it builds
    #    anything. The device comes first: the TE patch creates its CP stream on the current CUDA device.
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if has_gpu else torch.device("cpu")
    if has_gpu:
        torch.cuda.set_device(device)
    patches = megatron_patch_registry().apply()

    from megatron.core import parallel_state, tensor_parallel

    from dcp_megatron.megatron import checkpoint, model_setup
    from dcp_megatron.megatron.domain import build_group_pool
    from dcp_megatron.megatron.plan_dump import PlanDumper
    from dcp_megatron.megatron.plan_microbatches import num_rank_microbatches, rank_microbatches
    from dcp_megatron.megatron.planning import build_cost_model, check_same_plan, plan_step
    from dcp_megatron.megatron.train_step import format_log_line, train_step
    from dcp_megatron.runtime.group_pool import plan_blocks

    # 4. Distributed start-up, Megatron's parallel state (TP x PP x DP; its own CP stays 1) and the
    #    pool of CP groups over each TP/PP coordinate's DP x CP domain.
    init_distributed(backend="nccl" if has_gpu else "gloo")
    rank = torch.distributed.get_rank()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
    )
    pool = build_group_pool(tp_size=args.tensor_model_parallel_size, pp_size=args.pipeline_model_parallel_size,
                            timeout=GROUP_TIMEOUT)
    torch.manual_seed(args.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    is_logging_rank = rank == 0

    # 5. Model, DDP, optimizer, LR schedule.
    config = model_setup.transformer_config(args)
    model = model_setup.build_model(args, config)
    model = model_setup.wrap_ddp(model, config)
    optimizer = model_setup.build_optimizer(args, model)
    lr_schedule = model_setup.build_lr_schedule(args, optimizer)

    # 6. The cost model the planner scores plans with.
    vocab = model_setup.padded_vocab_size(args.vocab_size, divisible_by=args.make_vocab_size_divisible_by,
                                          tp_size=args.tensor_model_parallel_size)
    cost = build_cost_model(args, padded_vocab_size=vocab, domain_size=pool.domain_size, has_gpu=has_gpu)
    # Local rows per micro-batch: split over TP with sequence parallelism; FP8 GEMMs need multiples of 16.
    rows_multiple = math.lcm(args.tensor_model_parallel_size if args.sequence_parallel else 1,
                             16 if args.fp8_format else 1)

    # 7. Resume (model, optimizer, schedule, RNG and the data position).
    iteration = 0
    if args.load is not None:
        iteration, data_state = checkpoint.load_checkpoint(
            args.load, args=args, model=model, optimizer=optimizer, lr_schedule=lr_schedule)
        if data_state is not None:
            stream.load_state_dict(data_state)
        if is_logging_rank:
            print(f"loaded checkpoint from {args.load} at iteration {iteration}", flush=True)

    tensorboard = None
    if args.tensorboard_dir is not None and is_logging_rank:
        from torch.utils.tensorboard import SummaryWriter
        tensorboard = SummaryWriter(log_dir=args.tensorboard_dir)
    dumper = PlanDumper(args.dcp_dump_plans) if args.dcp_dump_plans and is_logging_rank else None

    # 8. Train: plan the global batch, run this rank's micro-batches, step.
    model.train()
    consumed_tokens = 0
    while iteration < args.train_iters:
        batch = next(stream)
        plan = plan_step(args, batch.sequences, cost)
        if args.dcp_check_plans:
            check_same_plan(plan, iteration=iteration + 1, device=device)
        pool.ensure_groups(plan_blocks(plan))  # collective when the plan needs a new block; same on every rank
        microbatches = rank_microbatches(plan, pool=pool, source=documents, batch=batch,
                                         rows_multiple=rows_multiple, device=device)
        lr = optimizer.param_groups[0]["lr"]  # the rate this step uses (the schedule advances in train_step)
        result = train_step(microbatches, num_microbatches=num_rank_microbatches(plan, pool.domain_rank), plan=plan,
                            model=model, optimizer=optimizer, lr_schedule=lr_schedule, config=config,
                            domain_group=pool.domain_group, device=device)
        iteration += 1
        consumed_tokens += result.num_tokens
        if is_logging_rank and iteration % args.log_interval == 0:
            print(format_log_line(iteration, args.train_iters, result, lr=lr, consumed_tokens=consumed_tokens),
                  flush=True)
        if dumper is not None:
            dumper.write(iteration, plan)
        if tensorboard is not None:
            tensorboard.add_scalar("lm loss", result.loss, iteration)
            tensorboard.add_scalar("tokens/s", result.num_tokens / result.step_time_s, iteration)
            tensorboard.add_scalar("learning rate", lr, iteration)
            tensorboard.add_scalar("imbalance", result.imbalance, iteration)
        if args.save is not None and args.save_interval is not None and iteration % args.save_interval == 0:
            checkpoint.save_checkpoint(args.save, iteration=iteration, data_state=stream.state_dict(), args=args,
                                       model=model, optimizer=optimizer, lr_schedule=lr_schedule)

    # 9. Save and shut down.
    if args.save is not None:
        checkpoint.save_checkpoint(args.save, iteration=iteration, data_state=stream.state_dict(), args=args,
                                   model=model, optimizer=optimizer, lr_schedule=lr_schedule)
    if tensorboard is not None:
        tensorboard.close()
    torch.distributed.barrier()
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    patches.remove()


if __name__ == "__main__":
    try:
        main()
    except ValueError as err:
        # User mistakes (flags, data, checkpoints): one clear line, no traceback.
        print(f"pretrain_gpt.py: error: {err}", file=sys.stderr)
        sys.exit(2)
