"""GPT pretraining on the DeepSpeed engine, with or without `--dcp` (dcp-megatron's DeepSpeed script).

    deepspeed --num_gpus 8 pretrain_scripts/pretrain_gpt_deepspeed.py --deepspeed-config ds.json \
        <Megatron's model, data and batch flags> --train-iters 1000 [--dcp --dcp-* | "dcp" block in ds.json]
    torchrun --nproc-per-node 2 pretrain_scripts/pretrain_gpt_deepspeed.py ...   (the same; on CPU: gloo)

One flag set for both engines: the flags are Megatron's (megatron.training's parser and `validate_args`:
`--global-batch-size`, `--micro-batch-size`, `--seq-length`, `--tokenizer-type`, `--data-path` blends,
`--split`, `--mock-data`, the model flags, `--save`/`--load`/`--save-interval`, `--seed`), and so is the
data (Megatron's tokenizer, GPT datasets, blended builder and pretraining sampler: each step trains the
`--global-batch-size` samples Megatron's loop would). The model is megatron-core's GPTModel from the
same flags (`core_transformer_config_from_args`; TP = PP = 1: DeepSpeed's data-parallel group, the world,
is the DCP domain). DeepSpeed owns the rest: the JSON config (ZeRO stage, bf16 or fp32, gradient clipping,
the optimizer and scheduler blocks; Megatron's optimizer flags are written into it, its schedule flags run
Megatron's own scheduler on the engine: dcp_megatron/deepspeed/megatron_flags.py, lr_schedule.py),
`deepspeed.initialize`, `save_checkpoint`/`load_checkpoint` (our data position travels in its client
state) and its progress lines (`steps_per_print`).

With `--dcp` each global batch is planned (CP size per document, micro-batches per rank, recompute per
micro-batch); without it the same documents run Megatron's static layout (one CP size for the run, the
same micro-batch count on every rank). Both train each batch's per-token loss, so loss traces of any
layout and world size agree. Without a GPU the CPU flags are defaulted (dcp_megatron/flags/cpu_defaults.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dcp_megatron.config import DcpUsageError  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    """Megatron's flags and checks plus --deepspeed-config and ours (dcp_megatron/deepspeed/arguments.py)."""
    from dcp_megatron.deepspeed.arguments import parse_args as parse_megatron_args

    return parse_megatron_args(argv)


def deepspeed_setup(args: argparse.Namespace, *, has_gpu: bool):
    """The DeepSpeed config the engine gets and the run's DcpConfig (policy "static" without --dcp)."""
    from dcp_megatron.deepspeed.config import (DEFAULT_CP_ATTENTION, check_precision_runs_here,
                                               check_schedule_length, dcp_config,
                                               load_deepspeed_config, prepare_deepspeed_config, torch_adam_params,
                                               zero_stage)
    from dcp_megatron.config import DcpConfig, parse_comma_list
    from dcp_megatron.flags.dcp_flags import policy_setting_from_flag
    from dcp_megatron.flags.run_paths import check_writable_dir

    from dcp_megatron.deepspeed.megatron_flags import apply_megatron_flags

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
    cli = {"policy": args.dcp_policy, "max_cp_size": args.dcp_max_cp_size, "memory_budget_gb": args.dcp_memory_budget_gb,
           "recompute": parse_comma_list(args.dcp_recompute), "profile": args.dcp_profile, "dump_plans": args.dcp_dump_plans,
           "check_plans": True if args.dcp_check_plans else None, "gpus_per_node": args.dcp_gpus_per_node,
           "plan_ahead": False if args.dcp_sync_planning else None, "refine": False if args.dcp_no_refine else None,
           "cp_attention": parse_comma_list(args.dcp_cp_attention),
           "policy_setting": policy_setting_from_flag(args.dcp_policy_setting, args.dcp_policy)}
    # Transformer Engine's attention (GPU) runs its own CP comm type; the per-micro-batch Ulysses flavour is
    # our torch attention's (the local spec), so on GPU plans use the all-gather flavour.
    config = dcp_config(user_config, cli=cli, seq_length=args.seq_length, train_iters=args.train_iters,
                        log_interval=args.log_interval, dcp_flag=args.dcp,
                        default_cp_attention=("allgather",) if has_gpu else DEFAULT_CP_ATTENTION,
                        domain_size=int(os.environ.get("WORLD_SIZE", 1)), stage=zero_stage(ds_config))
    if config is not None and has_gpu and "ulysses" in config.cp_attention:
        raise DcpUsageError("Ulysses CP attention (--dcp-cp-attention / \"cp_attention\") is not wired to Transformer "
                            "Engine's attention yet; on GPU use the all-gather flavour")
    if config is not None and config.dump_plans:  # also when set in the "dcp" block
        check_writable_dir(config.dump_plans, '"dcp" dump_plans')
    if args.load:
        from dcp_megatron.deepspeed.checkpoint import check_resume

        check_resume(args.load, ds_config, override=args.override_optimizer_config,
                     rank=int(os.environ.get("RANK", 0)), world_size=int(os.environ.get("WORLD_SIZE", 1)))
    if config is None:  # Megatron's static layout, on the same batches
        config = DcpConfig(policy="static", seq_length=args.seq_length, train_iters=args.train_iters,
                           log_interval=args.log_interval, refine=False)
    return ds_config, config


def build_model(args: argparse.Namespace, *, has_gpu: bool, bf16: bool):
    """megatron-core's GPTModel from Megatron's model flags for TP = PP = 1, initialised from --seed (the same
    weights on every rank and world size; Megatron's model-parallel state must be set up first, see
    setup_training). Precision is the DeepSpeed JSON's; the local spec (our packed CP attention) on CPU."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                          get_gpt_layer_with_transformer_engine_spec)
    from megatron.training.arguments import core_transformer_config_from_args

    torch.manual_seed(args.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    config = core_transformer_config_from_args(args)
    config.bf16, config.fp16 = bf16, False
    config.params_dtype = torch.bfloat16 if bf16 else torch.float32
    # DeepSpeed reduces gradients itself: Megatron's fused accumulation into main_grad has no buffer here.
    config.gradient_accumulation_fusion = False
    if args.transformer_impl == "transformer_engine":
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=args.qk_layernorm)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm, normalization=args.normalization)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                     max_sequence_length=args.max_position_embeddings, parallel_output=True,
                     share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                     position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                     rotary_base=args.rotary_base)
    return model, config


def initialize_engine(model, ds_config: dict, schedule):
    """DeepSpeed's engine over the model; with Megatron's schedule flags (`schedule`: lr_schedule.MegatronSchedule)
    it steps Megatron's scheduler, built over the optimizer DeepSpeed builds from the JSON."""
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(model=model, config=ds_config,
                                           model_parameters=[p for p in model.parameters() if p.requires_grad],
                                           lr_scheduler=None if schedule is None else schedule.build)
    return engine


def forward_loss(engine, batch: dict):
    """(sum of the micro-batch's masked token losses, its valid token count): the per-token loss."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from dcp_megatron.core.microbatch_facts import MICROBATCH_KEY, attach_facts

    bounds = batch["cu_seqlens_padded"].view(-1)
    max_seqlen = int(batch["max_seqlen"].max())
    facts = batch[MICROBATCH_KEY]
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, cu_seqlens_q_padded=bounds,
                             cu_seqlens_kv_padded=bounds, max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen,
                             local_cp_size=facts.cp_size, cp_group=facts.group)
    attach_facts(params, facts)   # what attention reads of the micro-batch: its shard and CP flavour (docs/deepspeed.md)
    losses = engine(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], packed_seq_params=params)
    mask = batch["loss_mask"].view(-1).float()
    return torch.sum(losses.view(-1).float() * mask), int(mask.sum())


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


def setup_training(args: argparse.Namespace) -> Training:
    """Configs (checked before anything heavy is imported), distributed init, data, model, engine, cost model
    and planned steps, in that order."""
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
    # the ZeRO stage shards the static memory; stage 3 gathers weights per micro-batch: lockstep plans
    shape = dataclasses.replace(model_shape_from_args(args), zero_stage=zero_stage(ds_config))
    cost = checked_cost_model(config, shape, domain_size=world_size, has_gpu=has_gpu)

    import deepspeed
    from megatron.core import parallel_state

    from patches.sets import patch_set
    from dcp_megatron.runtime.group_pool import GroupPool

    timeout = timedelta(minutes=args.distributed_timeout_minutes)
    if has_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    registry = patch_set("deepspeed", timeout=timeout).apply()   # before init: it skips the shm op's build
    try:
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
        model, model_config = build_model(args, has_gpu=has_gpu, bf16=bf16)
        engine = initialize_engine(model, ds_config, schedule)
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


def log_step(training: Training, outcome, *, iteration: int, train_iters: int, consumed: int) -> None:
    """Megatron's iteration line (loss, grad norm, learning rate) and the step's plan line."""
    from dcp_megatron.core.plan_log import plan_summary

    engine, steps = training.engine, training.steps
    norm = f" grad norm: {outcome.grad_norm:.6f} |" if outcome.grad_norm is not None else ""
    lr = engine.get_lr()[0] if engine.get_lr() else float("nan")
    print(f" iteration {iteration:8d}/{train_iters:8d} | consumed tokens: {consumed:12d} | "
          f"lm loss: {outcome.loss:.6E} |{norm} learning rate: {lr:.6E} | step time (ms): "
          f"{outcome.seconds * 1000:.1f} |", flush=True)
    plan, planned = steps.last_plan, steps.last_planning
    print(f" dcp iteration {iteration:8d} | {plan_summary(plan)} | predicted (ms): "
          f"{plan.est_step_time_s * 1000:.1f} | forward-backward (ms): {outcome.seconds * 1000:.1f} | planning "
          f"(ms): {planned.plan_s * 1000:.1f} {'ahead' if planned.ahead else 'at step start'}, exposed "
          f"{planned.exposed_s * 1000:.1f} | rank 0 ran {outcome.num_microbatches} micro-batches, cp sizes "
          f"{list(outcome.cp_sizes)} |", flush=True)


def log_validation(training: Training, where: str) -> None:
    """Megatron's validation line (megatron.training's evaluate_and_print_results)."""
    loss = training.evaluation.evaluate(training.engine)
    if training.rank == 0:
        print(f" validation loss at {where} | lm loss value: {loss:.6E} | lm loss PPL: {math.exp(min(20, loss)):.6E} |",
              flush=True)


def train(args: argparse.Namespace) -> None:
    from dcp_megatron.deepspeed import checkpoint
    from dcp_megatron.runtime.heartbeat import Heartbeat, connect_store, is_collective_timeout, timeout_message

    training = setup_training(args)
    engine, steps, rank = training.engine, training.steps, training.rank
    iteration, consumed = 0, 0
    if args.load:
        iteration, data_state = checkpoint.load(engine, args.load, apply_config=args.override_optimizer_config)
        try:
            steps.load_state_dict(data_state["samples"])
        except (KeyError, ValueError) as err:
            raise DcpUsageError(f"--load {args.load}: the checkpoint's data position does not fit this run "
                                f"({err})") from None
        consumed = int(data_state["consumed_tokens"])
        if training.evaluation is not None:
            training.evaluation.shares.start(int(data_state.get("valid_samples", 0)))
        if rank == 0:
            print(f"resumed from {args.load} at iteration {iteration} ({consumed} tokens trained)", flush=True)
    store = connect_store()
    heartbeat = None if store is None else Heartbeat(store, rank=rank, world_size=torch.distributed.get_world_size(),
                                                     step_of=lambda: iteration + 1).start()
    started = time.perf_counter()
    where = "start"
    try:
        while iteration < args.train_iters:
            where = f"iteration {iteration + 1}"
            outcome = steps.train_step(engine, last=iteration + 1 == args.train_iters)
            iteration += 1
            consumed += outcome.num_tokens
            if rank == 0 and iteration % args.log_interval == 0:
                log_step(training, outcome, iteration=iteration, train_iters=args.train_iters, consumed=consumed)
            if training.evaluation is not None and iteration % args.eval_interval == 0:
                where = f"evaluating at iteration {iteration}"
                log_validation(training, f"iteration {iteration} on validation set")   # before the save, as Megatron
            if args.save and args.save_interval and (iteration % args.save_interval == 0
                                                     or iteration == args.train_iters):
                where = f"saving iteration {iteration}"
                if rank == 0:
                    print(f"saving checkpoint at iteration {iteration} to {args.save}", flush=True)
                valid = {} if training.evaluation is None else {
                    "valid_samples": training.evaluation.shares.consumed_samples}   # as Megatron's consumed_valid_samples
                checkpoint.save(engine, args.save, iteration=iteration, ds_config=training.ds_config,
                                data_state={"samples": steps.state_dict(), "consumed_tokens": consumed, **valid})
        if training.evaluation is not None:
            where = "evaluating at the end of training"
            log_validation(training, "the end of training for val data")
    except (FloatingPointError, RuntimeError) as err:  # non-finite loss, lost tokens, a collective timed out
        if is_collective_timeout(err):
            message = timeout_message(heartbeat, rank=rank, where=where,
                                      timeout_minutes=args.distributed_timeout_minutes)
            print(f"error: {message} ({str(err).splitlines()[0][:200]})", file=sys.stderr, flush=True)
        else:
            print(f"error: rank {rank}, {where}: {err}", file=sys.stderr, flush=True)
        raise SystemExit(1) from err
    finally:
        if heartbeat is not None:
            heartbeat.close()
    if rank == 0:
        print(f"done: {iteration} iterations in {time.perf_counter() - started:.1f} s", flush=True)
    torch.distributed.barrier()
    training.close()


def main(argv=None) -> int:
    """The script as a command: 0 when trained, 2 (one line on stderr, nothing trained) for a usage error."""
    try:
        args = parse_args(argv)
        train(args)
    except DcpUsageError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
