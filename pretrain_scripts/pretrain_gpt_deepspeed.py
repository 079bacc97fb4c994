"""GPT pretraining on the DeepSpeed engine, with or without `--dcp` (dcp-megatron's DeepSpeed script).

    deepspeed --num_gpus 8 pretrain_scripts/pretrain_gpt_deepspeed.py --deepspeed-config ds.json <model flags> \
        --data-path PREFIX --tokens-per-step 1048576 --train-iters 1000 [--dcp | "dcp" block in ds.json]
    torchrun --nproc-per-node 2 pretrain_scripts/pretrain_gpt_deepspeed.py ...   (the same; on CPU: gloo)

The model is megatron-core's GPTModel built from the same model flags as our Megatron script (TP = PP
= 1: DeepSpeed's data-parallel group, the world, is the DCP domain); the Transformer Engine layer spec
on GPU, the local spec with our packed CP attention on CPU. DeepSpeed owns the rest: the JSON config
(ZeRO stage, bf16 or fp32, gradient clipping, the optimizer and scheduler blocks), `deepspeed.initialize`,
`save_checkpoint`/`load_checkpoint` (our data position travels in its client state) and its progress
lines (`steps_per_print`).

Every step trains one global batch of `--tokens-per-step` tokens of whole documents (at most
`--seq-length` each). With `--dcp` each batch is planned (CP size per document, micro-batches per rank,
recompute per micro-batch); without it the same batches run Megatron's static layout (one CP size for
the run, the same micro-batch count on every rank). Both train each batch's per-token loss, so loss
traces of any layout and world size agree.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dcp_megatron.megatron.dcp_args import DcpUsageError, add_dcp_arguments  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_argument_group("model (the names of Megatron's flags)")
    model.add_argument("--num-layers", type=int, required=True)
    model.add_argument("--hidden-size", type=int, required=True)
    model.add_argument("--num-attention-heads", type=int, required=True)
    model.add_argument("--num-query-groups", type=int, default=None, help="key/value heads (default: all heads)")
    model.add_argument("--kv-channels", type=int, default=None, help="head dimension (default hidden / heads)")
    model.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden")
    model.add_argument("--seq-length", type=int, required=True, help="the longest document a step may hold")
    model.add_argument("--max-position-embeddings", type=int, default=None)
    model.add_argument("--vocab-size", type=int, required=True)
    model.add_argument("--swiglu", action="store_true")
    model.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    model.add_argument("--position-embedding-type", choices=("rope", "learned_absolute"), default="rope")
    model.add_argument("--rotary-base", type=int, default=10000)
    model.add_argument("--disable-bias-linear", action="store_true")
    model.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    model.add_argument("--init-method-std", type=float, default=0.02)
    data = parser.add_argument_group("data")
    data.add_argument("--data-path", default=None, help="megatron-core indexed dataset prefix (.bin/.idx)")
    data.add_argument("--mock-data", action="store_true", help="synthetic long-tailed documents instead")
    data.add_argument("--mock-documents", type=int, default=20000)
    data.add_argument("--tokens-per-step", type=int, required=True, help="tokens of one global batch")
    data.add_argument("--overlong", choices=("error", "split", "truncate"), default="error",
                      help="documents longer than --seq-length: refuse at start (default), split or truncate")
    data.add_argument("--seed", type=int, default=1234)
    train = parser.add_argument_group("training")
    train.add_argument("--deepspeed-config", required=True, help="DeepSpeed JSON (may hold a \"dcp\" block)")
    train.add_argument("--train-iters", type=int, required=True)
    train.add_argument("--log-interval", type=int, default=1)
    train.add_argument("--save", default=None, help="DeepSpeed checkpoint directory")
    train.add_argument("--save-interval", type=int, default=None)
    train.add_argument("--load", default=None, help="resume from this DeepSpeed checkpoint directory")
    train.add_argument("--override-optimizer-config", action="store_true",
                       help="on --load, train with the config's optimizer/scheduler settings where they changed")
    train.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                       help="every collective of the run gives up after this long and names the step")
    train.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    add_dcp_arguments(parser)
    args = parser.parse_args(argv)
    check_args(args)
    return args


def check_args(args: argparse.Namespace) -> None:
    """Start-up checks of flags and paths: before any process group, model or data is touched."""
    from dcp_megatron.deepspeed.checkpoint import check_checkpoint_paths

    if (args.data_path is None) == (not args.mock_data):
        raise DcpUsageError("give exactly one of --data-path PREFIX and --mock-data")
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size",
                 "tokens_per_step", "train_iters", "log_interval"):
        if getattr(args, flag) < 1:
            raise DcpUsageError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.tokens_per_step < args.seq_length:
        raise DcpUsageError(f"--tokens-per-step {args.tokens_per_step} is below --seq-length {args.seq_length}: "
                            "a step could not hold its longest document")
    if args.save_interval is not None and not args.save:
        raise DcpUsageError("--save-interval needs --save DIR")
    if not (args.distributed_timeout_minutes > 0):
        raise DcpUsageError(f"--distributed-timeout-minutes must be positive, got {args.distributed_timeout_minutes}")
    check_checkpoint_paths(save=args.save, load=args.load, dump_plans=args.dcp_dump_plans)


def deepspeed_setup(args: argparse.Namespace, *, has_gpu: bool):
    """The DeepSpeed config the engine gets and the run's DcpConfig (policy "static" without --dcp)."""
    from dcp_megatron.deepspeed.config import (DEFAULT_CP_ATTENTION, check_schedule_length, dcp_config,
                                               load_deepspeed_config, prepare_deepspeed_config, torch_adam_params)
    from dcp_megatron.megatron.dcp_args import DcpConfig, parse_comma_list
    from dcp_megatron.megatron.run_paths import check_writable_dir

    user_config = load_deepspeed_config(args.deepspeed_config)
    ds_config = prepare_deepspeed_config(user_config)
    check_schedule_length(ds_config, train_iters=args.train_iters)
    if "optimizer" not in ds_config:
        raise DcpUsageError(f'--deepspeed-config {args.deepspeed_config}: add an "optimizer" block (e.g. '
                            '{"type": "AdamW", "params": {"lr": 3e-4}}); the script builds no optimizer of its own')
    torch_adam_params(ds_config["optimizer"], has_gpu=has_gpu)   # no JIT-compiled Adam op (config.py)
    cli = {"policy": args.dcp_policy, "max_cp_size": args.dcp_max_cp_size, "memory_budget_gb": args.dcp_memory_budget_gb,
           "recompute": parse_comma_list(args.dcp_recompute), "profile": args.dcp_profile, "dump_plans": args.dcp_dump_plans,
           "check_plans": True if args.dcp_check_plans else None, "gpus_per_node": args.dcp_gpus_per_node,
           "plan_ahead": False if args.dcp_sync_planning else None, "refine": False if args.dcp_no_refine else None,
           "cp_attention": parse_comma_list(args.dcp_cp_attention)}
    # Transformer Engine's attention (GPU) runs its own CP comm type; the per-micro-batch Ulysses flavour is
    # our torch attention's (the local spec), so on GPU plans use the all-gather flavour.
    config = dcp_config(user_config, cli=cli, seq_length=args.seq_length, train_iters=args.train_iters,
                        log_interval=args.log_interval, dcp_flag=args.dcp,
                        default_cp_attention=("allgather",) if has_gpu else DEFAULT_CP_ATTENTION)
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
    """megatron-core's GPTModel for TP = PP = 1, initialised from --seed (the same weights on every rank and
    world size; Megatron's model-parallel state must be set up first, see setup_training)."""
    import torch.nn.functional as F
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                          get_gpt_layer_with_transformer_engine_spec)
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(args.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    heads = args.num_attention_heads
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=heads,
        num_query_groups=args.num_query_groups or heads, kv_channels=args.kv_channels or args.hidden_size // heads,
        ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size, normalization=args.normalization,
        gated_linear_unit=args.swiglu, activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=not args.disable_bias_linear, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=args.init_method_std, use_cpu_initialization=not has_gpu, bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32, gradient_accumulation_fusion=False,
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False)
    spec = (get_gpt_layer_with_transformer_engine_spec() if has_gpu
            else get_gpt_layer_local_spec(normalization=args.normalization))
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.vocab_size,
                     max_sequence_length=args.max_position_embeddings or args.seq_length,
                     share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                     position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base)
    return model, config


def document_source(args: argparse.Namespace):
    from dcp_megatron.data.documents import MockDocuments
    from dcp_megatron.megatron.indexed_documents import IndexedDataError, IndexedDocuments

    if args.mock_data:
        return MockDocuments(seed=args.seed, num_documents=args.mock_documents, max_len=args.seq_length,
                             vocab_size=args.vocab_size)
    try:
        return IndexedDocuments(args.data_path, vocab_size=args.vocab_size)
    except (IndexedDataError, OSError) as err:   # the message names the file and what is wrong with it
        raise DcpUsageError(f"--data-path {args.data_path}: {err}") from None


def forward_loss(engine, batch: dict):
    """(sum of the micro-batch's masked token losses, its valid token count): the per-token loss."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from dcp_megatron.megatron.core_attention import set_cp_attention
    from dcp_megatron.megatron.microbatches import MICROBATCH_KEY

    bounds = batch["cu_seqlens_padded"].view(-1)
    max_seqlen = int(batch["max_seqlen"].max())
    context = batch[MICROBATCH_KEY]
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, cu_seqlens_q_padded=bounds,
                             cu_seqlens_kv_padded=bounds, max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen,
                             local_cp_size=context.cp_size, cp_group=context.group)
    set_cp_attention(params, context.attention)   # the CP flavour the plan chose for this micro-batch
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

    def close(self) -> None:
        from megatron.core import parallel_state

        self.steps.close()
        parallel_state.destroy_model_parallel()
        self.registry.remove()


def setup_training(args: argparse.Namespace) -> Training:
    """Configs and data (checked before anything heavy is imported), distributed init, model, engine, cost model
    and planned steps, in that order."""
    has_gpu = torch.cuda.is_available()
    ds_config, config = deepspeed_setup(args, has_gpu=has_gpu)
    from dcp_megatron.data.batches import GlobalBatchStream
    from dcp_megatron.megatron.planning import checked_cost_model
    from dcp_megatron.planner.model import ModelShape

    source = document_source(args)
    stream = GlobalBatchStream(source, tokens_per_step=args.tokens_per_step, max_seq_len=args.seq_length,
                               seed=args.seed, overlong=args.overlong)
    if "WORLD_SIZE" not in os.environ:  # a plain `python pretrain_gpt_deepspeed.py`: one process
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29500"))
    world_size = int(os.environ["WORLD_SIZE"])   # set by torchrun / deepspeed: the DCP domain
    shape = ModelShape(num_layers=args.num_layers, hidden_size=args.hidden_size, num_heads=args.num_attention_heads,
                       num_kv_heads=args.num_query_groups or args.num_attention_heads,
                       head_dim=args.kv_channels or args.hidden_size // args.num_attention_heads,
                       ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size, vocab_size=args.vocab_size,
                       gated_mlp=args.swiglu, tp=1, pp=1)
    cost = checked_cost_model(config, shape, domain_size=world_size, has_gpu=has_gpu)

    import deepspeed
    from megatron.core import parallel_state

    from dcp_megatron.deepspeed.patch_set import deepspeed_patch_registry
    from dcp_megatron.deepspeed.steps import DcpSteps
    from dcp_megatron.runtime.group_pool import GroupPool

    timeout = timedelta(minutes=args.distributed_timeout_minutes)
    if has_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    registry = deepspeed_patch_registry(timeout=timeout).apply()   # before init: it skips the shm op's build
    try:
        deepspeed.init_distributed(dist_backend="nccl" if has_gpu else "gloo", timeout=timeout)
        if torch.distributed.get_world_size() != world_size:
            raise RuntimeError(f"WORLD_SIZE says {world_size} ranks, the process group has "
                               f"{torch.distributed.get_world_size()}")
        # TP = PP = 1: Megatron's groups the model reads; DeepSpeed's data-parallel group is the world.
        parallel_state.initialize_model_parallel(1, 1, distributed_timeout_minutes=args.distributed_timeout_minutes)
        bf16 = bool((ds_config.get("bf16") or {}).get("enabled"))
        model, model_config = build_model(args, has_gpu=has_gpu, bf16=bf16)
        engine, _, _, _ = deepspeed.initialize(model=model, config=ds_config,
                                               model_parameters=[p for p in model.parameters() if p.requires_grad])
        device = torch.device("cuda", torch.cuda.current_device()) if has_gpu else torch.device("cpu")
        pool = GroupPool([list(range(world_size))], timeout=timeout)
        rank = torch.distributed.get_rank()
        steps = DcpSteps(config=config, stream=stream, source=source, cost=cost, pool=pool, model_config=model_config,
                         forward_loss=forward_loss, device=device, is_logging_rank=rank == 0)
    except BaseException:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        registry.remove()
        raise
    return Training(engine=engine, steps=steps, rank=rank, ds_config=ds_config, registry=registry)


def log_step(training: Training, outcome, *, iteration: int, train_iters: int, consumed: int) -> None:
    """Megatron's iteration line (loss, grad norm, learning rate) and the step's plan line."""
    from dcp_megatron.megatron.plan_log import plan_summary

    engine, steps = training.engine, training.steps
    norm = f" grad norm: {outcome.grad_norm:.3f} |" if outcome.grad_norm is not None else ""
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


def train(args: argparse.Namespace) -> None:
    from dcp_megatron.deepspeed import checkpoint
    from dcp_megatron.runtime.heartbeat import Heartbeat, connect_store, is_collective_timeout, timeout_message

    training = setup_training(args)
    engine, steps, rank = training.engine, training.steps, training.rank
    iteration, consumed = 0, 0
    if args.load:
        iteration, data_state = checkpoint.load(engine, args.load, apply_config=args.override_optimizer_config)
        steps.load_state_dict(data_state["stream"])
        consumed = int(data_state["consumed_tokens"])
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
            outcome = steps.train_step(engine)
            iteration += 1
            consumed += outcome.num_tokens
            if rank == 0 and iteration % args.log_interval == 0:
                log_step(training, outcome, iteration=iteration, train_iters=args.train_iters, consumed=consumed)
            if args.save and args.save_interval and (iteration % args.save_interval == 0
                                                     or iteration == args.train_iters):
                where = f"saving iteration {iteration}"
                if rank == 0:
                    print(f"saving checkpoint at iteration {iteration} to {args.save}", flush=True)
                checkpoint.save(engine, args.save, iteration=iteration, ds_config=training.ds_config,
                                data_state={"stream": steps.state_dict(), "consumed_tokens": consumed})
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
