"""The DeepSpeed trainer's set-up: the run's configs, then distributed init, data, model, engine and planned steps.

`deepspeed_setup` turns the parsed flags (arguments.py) and the DeepSpeed JSON into the config the engine gets and
the run's DcpConfig, checked before anything heavy is imported; `setup_training` builds, in order, the process
groups (TP = PP = 1: DeepSpeed's data-parallel group, the world, is the DCP domain), Megatron's datasets and
samples (samples.py), the user's model (`model_provider`), DeepSpeed's engine, the cost model and the planned
steps (steps.py), and the evaluation (evaluation.py). The user's script supplies the model provider and the
forward/loss; the loop is trainer.py's.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from datetime import timedelta

import torch

from dcp_megatron.config import DcpUsageError

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported


def deepspeed_setup(args: argparse.Namespace, *, has_gpu: bool):
    """The DeepSpeed config the engine gets and the run's DcpConfig (policy "static" without --dcp)."""
    from dcp_megatron.deepspeed.config import (DEFAULT_CP_ATTENTION, check_precision_runs_here,
                                               check_schedule_length, dcp_config,
                                               load_deepspeed_config, prepare_deepspeed_config, torch_adam_params,
                                               zero_stage)
    from dcp_megatron.config import DcpConfig
    from dcp_megatron.core.out_of_memory import under_recorded_limit
    from dcp_megatron.flags.dcp_flags import dcp_flag_settings
    from dcp_megatron.deepspeed.megatron_flags import apply_megatron_flags
    from dcp_megatron.flags.run_paths import check_writable_dir

    # Megatron's optimizer, clipping and precision flags and the JSON: one setting (megatron_flags.py)
    user_config = apply_megatron_flags(load_deepspeed_config(args.deepspeed_config),
                                       getattr(args, "deepspeed_megatron_flags", {}), sgd_momentum=args.sgd_momentum)
    ds_config = prepare_deepspeed_config(user_config)
    check_precision_runs_here(ds_config, has_gpu=has_gpu)   # fp16 on a CPU without fp16 kernels
    check_schedule_length(ds_config, train_iters=args.train_iters)
    if "optimizer" not in ds_config:
        raise DcpUsageError(f'--deepspeed-config {args.deepspeed_config}: add an "optimizer" block (e.g. '
                            '{"type": "AdamW", "params": {"lr": 3e-4}}); the script builds no optimizer of its own')
    torch_adam_params(ds_config["optimizer"], has_gpu=has_gpu)   # no JIT-compiled Adam op (config.py)
    # Transformer Engine's attention (GPU) runs its own CP comm type; the per-micro-batch Ulysses flavour is
    # our torch attention's (the local spec), so on GPU plans use the all-gather flavour.
    config = dcp_config(user_config, cli=dcp_flag_settings(args), seq_length=args.seq_length,
                        train_iters=args.train_iters, log_interval=args.log_interval, dcp_flag=args.dcp,
                        default_cp_attention=("allgather",) if has_gpu else DEFAULT_CP_ATTENTION,
                        domain_size=int(os.environ.get("WORLD_SIZE", 1)), stage=zero_stage(ds_config),
                        timeout_minutes=args.distributed_timeout_minutes, has_gpu=has_gpu)
    if config is not None:   # Megatron's run-wide recompute flags: the plan's per-micro-batch recompute overrides them
        from dcp_megatron.flags.recompute_flags import check_megatron_recompute

        check_megatron_recompute(args)
    if getattr(args, "dcp_dump_saved_bytes", None):
        raise DcpUsageError(f"--dcp-dump-saved-bytes {args.dcp_dump_saved_bytes}: the saved-bytes record is written "
                            "by the megatron.training path's forward step only; drop it here")
    if config is not None and config.dump_plans and not args.dcp_dump_plans:   # (the flag: checkpoint paths)
        check_writable_dir(config.dump_plans, '"dcp" dump_plans')
    if args.load:
        from dcp_megatron.deepspeed.checkpoint import check_resume

        check_resume(args.load, ds_config, override=args.override_optimizer_config,
                     rank=int(os.environ.get("RANK", 0)), world_size=int(os.environ.get("WORLD_SIZE", 1)))
    if config is not None:   # a micro-batch that ran out of memory in an earlier run: plan under its count
        config, note = under_recorded_limit(config, args.load, args.save)
        if note and int(os.environ.get("RANK", 0)) == 0:
            print(note, flush=True)
    if config is None:  # Megatron's static layout, on the same batches
        config = DcpConfig(policy="static", seq_length=args.seq_length, train_iters=args.train_iters,
                           log_interval=args.log_interval, refine=False)
    return ds_config, config


def initialize_engine(model, ds_config: dict, schedule):
    """DeepSpeed's engine over the model; with Megatron's schedule flags (`schedule`: lr_schedule.MegatronSchedule)
    it steps Megatron's scheduler, built over the optimizer DeepSpeed builds from the JSON."""
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(model=model, config=ds_config,
                                           model_parameters=[p for p in model.parameters() if p.requires_grad],
                                           lr_scheduler=None if schedule is None else schedule.build)
    return engine


@dataclass
class Training:
    """What a run trains with: DeepSpeed's engine and the planned steps over the run's data."""

    engine: object
    steps: object
    rank: int
    ds_config: dict    # as the engine got it (its optimizer/scheduler blocks go into each checkpoint's manifest)
    registry: object   # the megatron-core patches applied for this run (removed by close())
    evaluation: object = None   # evaluation.Evaluation with --eval-interval / --eval-iters

    def close(self) -> None:
        from megatron.core import parallel_state

        self.steps.close()
        parallel_state.destroy_model_parallel()
        self.registry.remove()


def setup_training(args: argparse.Namespace, *, model_provider, forward_loss, patches) -> Training:
    """Configs (checked before anything heavy is imported), distributed init, data, model, engine, cost model
    and planned steps, in that order. `model_provider(args, has_gpu=, bf16=)`: the user's (model, its
    TransformerConfig); `forward_loss(engine, batch)`: the user's (token-loss sum, token count);
    `patches(timeout=)`: the DeepSpeed patch set, not applied (dcp_megatron.deepspeed_patches)."""
    has_gpu = torch.cuda.is_available()
    ds_config, config = deepspeed_setup(args, has_gpu=has_gpu)
    from dcp_megatron.deepspeed.lr_schedule import megatron_schedule

    schedule = megatron_schedule(args, ds_config)   # Megatron's schedule flags: its own scheduler, checked here
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    from dcp_megatron.deepspeed.config import zero_stage
    from dcp_megatron.deepspeed.evaluation import Evaluation, validation_samples
    from dcp_megatron.deepspeed.samples import SampleShares, build_train_dataset
    from dcp_megatron.deepspeed.steps import DcpSteps
    from dcp_megatron.core.planning import checked_cost_model, model_shape_from_args

    if "WORLD_SIZE" not in os.environ:  # a plain `python pretrain_gpt_deepspeed.py`: one process
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29500"))
    world_size = int(os.environ["WORLD_SIZE"])   # set by torchrun / deepspeed: the DCP domain
    try:
        tokenizer = build_tokenizer(args)   # also sets args.padded_vocab_size, as Megatron pads it
    except (ValueError, OSError, AssertionError) as err:
        raise DcpUsageError(f"--tokenizer-type {args.tokenizer_type}: {err}") from None
    if args.tokenizer_type != "NullTokenizer":   # (NullTokenizer's ids were checked with the flags, data_files.py)
        from dcp_megatron.flags.data_files import check_token_ids

        check_token_ids(args, vocab_size=tokenizer.vocab_size,
                        what=f"--tokenizer-type {args.tokenizer_type} ({tokenizer.vocab_size} ids)")
    # the ZeRO stage shards the static memory; stage 3 gathers weights per micro-batch: lockstep plans
    # the JSON's precision is the run's (--bf16 / --fp16 only fill it): its activations' width
    half = any((ds_config.get(kind) or {}).get("enabled") for kind in ("bf16", "fp16"))
    shape = dataclasses.replace(model_shape_from_args(args, dtype_bytes=2 if half else 4),
                                zero_stage=zero_stage(ds_config))
    from dcp_megatron.runtime.device_memory import cap_for_run

    cap_for_run(config.device_memory_gb, has_gpu=has_gpu,   # before anything is allocated: torch's allocator capped
                say=(lambda line: print(line, flush=True)) if os.environ.get("RANK", "0") == "0" else None)
    cost = checked_cost_model(config, shape, domain_size=world_size, has_gpu=has_gpu)

    import deepspeed
    from megatron.core import parallel_state

    from dcp_megatron.runtime.group_pool import GroupPool

    timeout = timedelta(minutes=args.distributed_timeout_minutes)
    if has_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    registry = patches(timeout=timeout).apply()   # before init: it skips the shm op's build
    try:
        from dcp_megatron.runtime.restart_store import init_after_restart

        init_after_restart(backend=args.distributed_backend, timeout=timeout)   # torchrun --max-restarts
        deepspeed.init_distributed(dist_backend=args.distributed_backend, timeout=timeout)
        if torch.distributed.get_world_size() != world_size:
            raise RuntimeError(f"WORLD_SIZE says {world_size} ranks, the process group has "
                               f"{torch.distributed.get_world_size()}")
        # TP = PP = 1: Megatron's groups the model reads; DeepSpeed's data-parallel group is the world.
        parallel_state.initialize_model_parallel(1, 1, distributed_timeout_minutes=args.distributed_timeout_minutes)
        rank = torch.distributed.get_rank()
        evaluate = getattr(args, "deepspeed_evaluate", False) and args.eval_iters > 0
        try:
            datasets = build_train_dataset(args, tokenizer, valid_samples=validation_samples(args) if evaluate else 0)
        except (ValueError, OSError, AssertionError) as err:   # a missing or inconsistent --data-path names itself
            raise DcpUsageError(f"--data-path {args.data_path}: {err}") from None
        dataset, valid = datasets if evaluate else (datasets, None)
        shares = SampleShares(dataset, global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size,
                              data_parallel_rank=rank, data_parallel_size=world_size)
        bf16 = bool((ds_config.get("bf16") or {}).get("enabled"))
        model, model_config = model_provider(args, has_gpu=has_gpu, bf16=bf16)
        engine = initialize_engine(model, ds_config, schedule)
        if has_gpu:   # the device read again now that the model, its gradients and optimizer states are built
            cost = checked_cost_model(config, shape, domain_size=world_size, has_gpu=True,
                                      say=(lambda line: print(line, flush=True)) if rank == 0 else None)
        device = torch.device("cuda", torch.cuda.current_device()) if has_gpu else torch.device("cpu")
        pool = GroupPool([list(range(world_size))], timeout=timeout)
        steps = DcpSteps(config=config, shares=shares, cost=cost, pool=pool, model_config=model_config,
                         forward_loss=forward_loss, device=device, is_logging_rank=rank == 0)
        evaluation = None if valid is None else Evaluation(
            shares=SampleShares(valid, global_batch_size=args.eval_global_batch_size,
                                micro_batch_size=args.eval_micro_batch_size, data_parallel_rank=rank,
                                data_parallel_size=world_size),
            config=config, cost=cost, pool=pool, forward_loss=forward_loss, device=device,
            eval_iters=args.eval_iters)
    except BaseException:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        registry.remove()
        raise
    return Training(engine=engine, steps=steps, rank=rank, ds_config=ds_config, registry=registry,
                    evaluation=evaluation)
