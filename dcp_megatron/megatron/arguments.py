"""Command-line flags of pretrain_gpt.py (Megatron-style names) and the checks made before any work.

`parse_args(argv, *, world_size, has_gpu)` returns an argparse namespace whose every flag has
been checked against the others, the world size and the machine; incompatible combinations
raise `ValueError` naming the flags and why, before distributed start-up or model building.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
from typing import Sequence

DCP_POLICIES = ("static", "static-balanced", "megatron-hybrid", "dcp")
RECOMPUTE_CHOICES = ("none", "selective", "full")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pretrain_gpt.py", description="GPT pretraining on megatron-core")
    par = parser.add_argument_group("parallelism")
    par.add_argument("--tensor-model-parallel-size", type=int, default=1)
    par.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    par.add_argument("--context-parallel-size", type=int, default=1)
    par.add_argument("--sequence-parallel", action="store_true")

    model = parser.add_argument_group("model")
    model.add_argument("--num-layers", type=int, required=True)
    model.add_argument("--hidden-size", type=int, required=True)
    model.add_argument("--num-attention-heads", type=int, required=True)
    model.add_argument("--num-query-groups", type=int, default=None, help="GQA key/value heads (default: no GQA)")
    model.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 x hidden size")
    model.add_argument("--vocab-size", type=int, default=None, help="tokenizer vocabulary (mock data: 512)")
    model.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    model.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    model.add_argument("--swiglu", action="store_true")
    model.add_argument("--disable-bias-linear", action="store_true")
    model.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    model.add_argument("--rotary-base", type=float, default=10000.0)
    model.add_argument("--init-method-std", type=float, default=0.02)
    model.add_argument("--hidden-dropout", type=float, default=0.0)
    model.add_argument("--attention-dropout", type=float, default=0.0)
    model.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    model.add_argument("--recompute-num-layers", type=int, default=None, help="full recompute: first N layers")

    data = parser.add_argument_group("data and schedule")
    data.add_argument("--data-path", default=None)
    data.add_argument("--mock-data", action="store_true")
    data.add_argument("--overlong", choices=("error", "split", "truncate"), default="error",
                      help="documents longer than --seq-length: stop with an error, split them, or truncate them")
    data.add_argument("--seq-length", type=int, required=True, help="longest training sequence (the length cap)")
    data.add_argument("--tokens-per-step", type=int, required=True, help="token budget of one global batch")
    data.add_argument("--train-iters", type=int, required=True)
    data.add_argument("--seed", type=int, default=1234)

    opt = parser.add_argument_group("optimizer")
    opt.add_argument("--lr", type=float, required=True)
    opt.add_argument("--min-lr", type=float, default=0.0)
    opt.add_argument("--lr-warmup-iters", type=int, default=0)
    opt.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    opt.add_argument("--weight-decay", type=float, default=0.01)
    opt.add_argument("--adam-beta1", type=float, default=0.9)
    opt.add_argument("--adam-beta2", type=float, default=0.95)
    opt.add_argument("--clip-grad", type=float, default=1.0)
    opt.add_argument("--fp8-format", choices=("e4m3", "hybrid"), default=None,
                     help="GPU with Transformer Engine only: TE layer spec, FP8 linears (needs --bf16)")
    opt.add_argument("--bf16", action="store_true", help="bf16 parameters and activations, fp32 main weights")
    model.add_argument("--attention-backend", choices=("auto", "local", "te"), default="auto",
                       help="core attention: te = Transformer Engine (GPU, --bf16), local = our CP attention; "
                            "auto = te when available with --bf16")

    io = parser.add_argument_group("checkpointing and logging")
    io.add_argument("--save", default=None)
    io.add_argument("--load", default=None)
    io.add_argument("--save-interval", type=int, default=None)
    io.add_argument("--tensorboard-dir", default=None)
    io.add_argument("--log-interval", type=int, default=1)

    dcp = parser.add_argument_group("data-centric parallelism")
    dcp.add_argument("--dcp", action="store_true", help="plan CP sizes, micro-batches and recompute per step")
    dcp.add_argument("--dcp-policy", choices=DCP_POLICIES, default=None, help="default: dcp")
    dcp.add_argument("--dcp-max-cp-size", type=int, default=None)
    dcp.add_argument("--dcp-memory-budget-gb", type=float, default=None)
    dcp.add_argument("--dcp-recompute", default=None, help=f"comma list of allowed: {','.join(RECOMPUTE_CHOICES)}")
    dcp.add_argument("--dcp-profile", default=None, help="profile JSON overriding the cost model's constants")
    dcp.add_argument("--dcp-dump-plans", default=None, metavar="DIR", help="write each step's plan JSON and PNG")
    dcp.add_argument("--dcp-check-plans", action="store_true", default=None,
                     help="debug: all-reduce a hash of each step's plan to prove every rank runs the same plan")
    return parser


def _positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")


def validate_args(args: argparse.Namespace, *, world_size: int, has_gpu: bool) -> argparse.Namespace:
    """Fill defaults that depend on other flags and reject incompatible combinations."""
    _positive(args, "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
              "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
              "vocab_size", "seq_length", "tokens_per_step", "train_iters", "lr", "log_interval",
              "save_interval", "recompute_num_layers", "dcp_max_cp_size", "dcp_memory_budget_gb")
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    if world_size % (tp * pp * cp):
        raise ValueError(f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
                         f"--pipeline-model-parallel-size {pp} x --context-parallel-size {cp}")
    # Megatron itself runs with CP 1: the runtime re-partitions the DP x CP domain (dcp_megatron/megatron/domain.py).
    args.data_parallel_size = world_size // (tp * pp)
    args.num_query_groups = args.num_query_groups or args.num_attention_heads
    args.ffn_hidden_size = args.ffn_hidden_size or 4 * args.hidden_size
    if args.hidden_size % args.num_attention_heads:
        raise ValueError(f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
                         f"{args.num_attention_heads}")
    if args.num_attention_heads % args.num_query_groups:
        raise ValueError(f"--num-attention-heads {args.num_attention_heads} is not a multiple of "
                         f"--num-query-groups {args.num_query_groups}")
    if args.num_query_groups % tp:
        raise ValueError(f"--num-query-groups {args.num_query_groups} (key/value heads) is not divisible by "
                         f"--tensor-model-parallel-size {tp}: each TP rank needs whole key/value heads")
    if args.num_layers % pp:
        raise ValueError(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
    if args.sequence_parallel and tp == 1:
        raise ValueError("--sequence-parallel splits activations over the TP group: it needs "
                         "--tensor-model-parallel-size > 1")
    if (args.data_path is None) == (not args.mock_data):
        raise ValueError("give exactly one of --data-path PATH and --mock-data")
    if args.mock_data and args.vocab_size is None:
        args.vocab_size = 512
    if args.vocab_size is None:
        raise ValueError("--vocab-size is required with --data-path (the tokenizer's vocabulary size)")
    if args.seq_length > args.tokens_per_step:
        raise ValueError(f"--seq-length {args.seq_length} exceeds --tokens-per-step {args.tokens_per_step}: "
                         "a sequence that long could never fit in a global batch")
    args.lr_decay_iters = args.lr_decay_iters or args.train_iters
    if args.lr_warmup_iters > args.lr_decay_iters:
        raise ValueError(f"--lr-warmup-iters {args.lr_warmup_iters} exceeds --lr-decay-iters {args.lr_decay_iters}")
    if args.min_lr > args.lr:
        raise ValueError(f"--min-lr {args.min_lr} exceeds --lr {args.lr}")
    if args.save_interval is not None and args.save is None:
        raise ValueError("--save-interval needs --save DIR")
    if args.recompute_num_layers is not None and args.recompute_granularity != "full":
        raise ValueError("--recompute-num-layers applies to --recompute-granularity full only")
    if args.recompute_granularity == "full" and args.recompute_num_layers is None:
        args.recompute_num_layers = args.num_layers // pp
    if args.tensorboard_dir is not None and importlib.util.find_spec("tensorboard") is None:
        raise ValueError("--tensorboard-dir needs the tensorboard package, which is not installed")
    if args.fp8_format is not None and not has_gpu:
        raise ValueError(f"--fp8-format {args.fp8_format} needs a GPU with Transformer Engine; "
                         "this machine has no GPU (CPU runs train in fp32)")
    if pp > 1 and not args.untie_embeddings_and_output_weights and not has_gpu:
        raise ValueError("tied embeddings with --pipeline-model-parallel-size > 1 need a GPU: megatron-core "
                         "0.16.1 copies the shared embedding with .cuda(); add "
                         "--untie-embeddings-and-output-weights on CPU")
    _validate_attention_backend(args, has_gpu=has_gpu)
    _validate_dcp(args, world_size=world_size)
    return args


def _te_importable() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def _validate_attention_backend(args: argparse.Namespace, *, has_gpu: bool) -> None:
    te_usable = has_gpu and _te_importable()
    if args.bf16 and not has_gpu:
        raise ValueError("--bf16 needs a GPU: megatron-core's mixed-precision optimizer wraps CUDA tensors only; "
                         "CPU runs train in fp32")
    if args.attention_backend == "te" and not te_usable:
        raise ValueError("--attention-backend te needs a GPU with Transformer Engine installed")
    if args.attention_backend == "te" and not args.bf16:
        raise ValueError("--attention-backend te needs --bf16: TE's packed (THD) attention kernels do not run fp32")
    if args.fp8_format is not None and not args.bf16:
        raise ValueError(f"--fp8-format {args.fp8_format} needs --bf16 (FP8 GEMMs with bf16 activations)")
    if args.fp8_format is not None and args.attention_backend == "local":
        raise ValueError("--fp8-format runs Transformer Engine layers; it conflicts with --attention-backend local")
    if args.attention_backend == "auto":
        args.attention_backend = "te" if te_usable and args.bf16 else "local"
    if args.fp8_format is not None:
        args.attention_backend = "te-fp8"


def _validate_dcp(args: argparse.Namespace, *, world_size: int) -> None:
    given = [f"--{name.replace('_', '-')}" for name, value in vars(args).items()
             if name.startswith("dcp_") and value is not None]
    cp = args.context_parallel_size
    if (args.dcp or cp > 1) and args.attention_dropout > 0:
        raise ValueError(f"--attention-dropout {args.attention_dropout} is not supported by the context-parallel "
                         "attention of --dcp / --context-parallel-size > 1; use 0")
    if not args.dcp:
        if given:
            raise ValueError(f"{', '.join(given)} only take effect with --dcp")
        return
    if cp > 1:
        raise ValueError(f"--context-parallel-size {cp} conflicts with --dcp: DCP chooses the CP size of every "
                         "sequence (cap it with --dcp-max-cp-size)")
    if args.recompute_granularity is not None:
        raise ValueError("--recompute-granularity conflicts with --dcp: DCP chooses recompute per micro-batch "
                         "(restrict it with --dcp-recompute)")
    if args.dcp_recompute is not None:
        names = [r.strip() for r in args.dcp_recompute.split(",") if r.strip()]
        bad = [r for r in names if r not in RECOMPUTE_CHOICES]
        if bad or not names:
            raise ValueError(f"--dcp-recompute {args.dcp_recompute!r}: unknown {bad or 'empty list'}, give a comma "
                             f"list from {RECOMPUTE_CHOICES}")
    if args.dcp_max_cp_size is not None and args.dcp_max_cp_size > args.data_parallel_size:
        raise ValueError(f"--dcp-max-cp-size {args.dcp_max_cp_size} exceeds the DCP domain of "
                         f"{args.data_parallel_size} ranks (world size / (TP x PP))")
    if args.dcp_profile is not None and not os.path.isfile(args.dcp_profile):
        raise ValueError(f"--dcp-profile {args.dcp_profile}: no such file")
    args.dcp_policy = args.dcp_policy or "dcp"


def parse_args(argv: Sequence[str] | None, *, world_size: int, has_gpu: bool) -> argparse.Namespace:
    return validate_args(build_parser().parse_args(argv), world_size=world_size, has_gpu=has_gpu)
