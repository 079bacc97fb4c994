"""The `--dcp*` flags inside Megatron's own argument parser, their checks, and the run's DcpConfig.

`add_dcp_arguments(parser)` adds one argument group to Megatron's parser (patches/training_arguments.py
calls it from `add_megatron_arguments`, so every script built on `megatron.training` has the flags).
`validate_dcp_args(args)` runs after Megatron's own `validate_args`: it refuses combinations DCP
cannot honour, with the reason and the flag to change, before any model is built. Everything
downstream gets only `DcpConfig`, never Megatron's whole `args`.
"""
from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass

from dcp_megatron.megatron.fp8_checks import fp8_row_multiple
from dcp_megatron.megatron.gpu_checks import check_gpu_path

DCP_POLICIES = ("static", "static-balanced", "megatron-hybrid", "megatron-dynamic", "dcp")
RECOMPUTE_CHOICES = ("none", "selective", "full")
CP_ATTENTION_CHOICES = ("allgather", "ulysses")


class DcpUsageError(ValueError):
    """A flag or input that --dcp cannot honour; the message says what to change."""


def add_dcp_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("data-centric parallelism (dcp-megatron)")
    group.add_argument("--dcp", action="store_true",
                       help="plan each global batch: CP size per document, micro-batches per rank, recompute")
    group.add_argument("--dcp-policy", choices=DCP_POLICIES, default=None, help="planner policy (default: dcp)")
    group.add_argument("--dcp-max-cp-size", type=int, default=None, help="largest CP group a document may use")
    group.add_argument("--dcp-memory-budget-gb", type=float, default=None,
                       help="memory per rank the planner may fill (GiB; default: the cluster preset's)")
    group.add_argument("--dcp-recompute", default=None,
                       help=f"comma list of recompute kinds the planner may choose from {','.join(RECOMPUTE_CHOICES)}")
    group.add_argument("--dcp-profile", default=None, help="measured profile JSON overriding the cost model")
    group.add_argument("--dcp-dump-plans", default=None, metavar="DIR", help="write each step's plan JSON to DIR")
    group.add_argument("--dcp-gpus-per-node", type=int, default=None,
                       help="ranks per node, for the planner's intra- vs inter-node bandwidth (default: torchrun's "
                            "LOCAL_WORLD_SIZE)")
    group.add_argument("--dcp-sync-planning", action="store_true",
                       help="plan each step on the training thread when it starts (default: plan it while the "
                            "previous step trains, one step ahead)")
    group.add_argument("--dcp-no-refine", action="store_true",
                       help="keep the cost model as given (default: correct it every step from measured "
                            "micro-batch times; PP 1 only)")
    group.add_argument("--dcp-cp-attention", default=None,
                       help="comma list of CP attention flavours the planner may choose per micro-batch from "
                            "allgather,ulysses (ulysses: DeepSpeed script only; default there: both)")
    group.add_argument("--dcp-row-alignment", type=int, default=None, metavar="N",
                       help="pad every micro-batch's token rows on a rank to a multiple of N with a masked filler "
                            "(default: 16 x TP-shards under --fp8-format, what TE's FP8 GEMMs need; else none)")
    group.add_argument("--dcp-check-plans", action="store_true",
                       help="all-reduce a hash of every plan to prove all ranks planned the same step (the default)")
    group.add_argument("--dcp-no-check-plans", action="store_true",
                       help="skip the per-step plan hash all-reduce (one 16-byte collective per step)")
    # set by dcp-profile (dcp_megatron/profile.py), which runs the user's script with them
    group.add_argument("--dcp-profile-out", default=None, metavar="PROFILE.json",
                       help="profile the model instead of training: time a grid of micro-batches, fit the cost "
                            "model, write the profile JSON --dcp-profile reads")
    group.add_argument("--dcp-profile-report", default=None, metavar="REPORT.json",
                       help="with --dcp-profile-out: write the held-back predicted-vs-measured comparison here")
    group.add_argument("--dcp-profile-repeats", type=int, default=None, help="timed runs per grid point (default 3)")
    group.add_argument("--dcp-profile-clock", choices=("cpu", "wall"), default=None,
                       help="CPU runs: time in process CPU time (default) or wall time; GPU runs use CUDA timing")
    group.add_argument("--dcp-profile-scale-to-layers", type=int, default=None, metavar="N",
                       help="the training run's --num-layers when the profiled model is built with fewer")
    return parser


@dataclass(frozen=True, kw_only=True)
class DcpConfig:
    """What the DCP adapter needs of a run (validated; built from Megatron's args once)."""

    policy: str = "dcp"
    max_cp_size: int | None = None
    memory_budget_gb: float | None = None
    recompute: tuple[str, ...] = RECOMPUTE_CHOICES
    profile: str | None = None
    dump_plans: str | None = None
    check_plans: bool = True         # one all-reduced plan hash per step (planning.check_same_plan)
    gpus_per_node: int | None = None
    seq_length: int
    log_interval: int = 1
    plan_ahead: bool = True          # plan step k+1 while step k trains (planner/ahead.py)
    train_iters: int | None = None   # the last step: nothing to read ahead after it
    iterations_to_skip: frozenset[int] = frozenset()   # --iterations-to-skip: Megatron reads those steps itself
    refine: bool = True              # correct the cost model from measured times (planner/refine.py)
    cp_attention: tuple[str, ...] = ("allgather",)   # CP attention flavours per micro-batch (+ "ulysses")
    row_multiple: int = 1            # each micro-batch's local rows padded to a multiple (FP8 GEMM shapes)
    fp8: bool = False                # linear GEMMs in FP8 (the cost model's FP8 rate and weight copies)
    te_attention: bool = False       # Transformer Engine's attention (on GPU: its p2p CP ring)

    def __post_init__(self) -> None:
        if self.policy not in DCP_POLICIES:
            raise DcpUsageError(f"--dcp-policy {self.policy!r} is not one of {DCP_POLICIES}")
        if self.max_cp_size is not None and self.max_cp_size < 1:
            raise DcpUsageError(f"--dcp-max-cp-size must be >= 1, got {self.max_cp_size}")
        if self.memory_budget_gb is not None and not (math.isfinite(self.memory_budget_gb)
                                                      and self.memory_budget_gb > 0):
            raise DcpUsageError(f"--dcp-memory-budget-gb must be a positive number of GiB, got {self.memory_budget_gb}")
        refuse_bad_recompute(self.recompute)
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise DcpUsageError(f"--dcp-gpus-per-node must be >= 1, got {self.gpus_per_node}")
        bad = [a for a in self.cp_attention if a not in CP_ATTENTION_CHOICES]
        if bad or not self.cp_attention:
            raise DcpUsageError(f"--dcp-cp-attention: unknown {bad or 'empty list'}; give a comma list from "
                                f"{','.join(CP_ATTENTION_CHOICES)}")
        if self.row_multiple < 1:
            raise DcpUsageError(f"--dcp-row-alignment must be >= 1, got {self.row_multiple}")
        if self.seq_length < 1:
            raise DcpUsageError(f"--seq-length must be positive, got {self.seq_length}")


def refuse_bad_recompute(kinds: tuple[str, ...]) -> None:
    """Both paths' one check of the recompute kinds: known names, and at least one (`""` is not "all")."""
    bad = [r for r in kinds if r not in RECOMPUTE_CHOICES]
    if bad or not kinds:
        raise DcpUsageError(f"--dcp-recompute: unknown {bad or 'empty list'}; give a comma list from "
                            f"{','.join(RECOMPUTE_CHOICES)}")


def recompute_choices(value: str | None) -> tuple[str, ...] | None:
    """--dcp-recompute as a checked tuple (None when the flag is not given)."""
    kinds = parse_comma_list(value)
    if kinds is not None:
        refuse_bad_recompute(kinds)
    return kinds


def dcp_config_from_args(args: argparse.Namespace) -> DcpConfig:
    recompute = recompute_choices(args.dcp_recompute) or RECOMPUTE_CHOICES
    return DcpConfig(policy=args.dcp_policy or "dcp", max_cp_size=args.dcp_max_cp_size,
                     memory_budget_gb=args.dcp_memory_budget_gb, recompute=recompute, profile=args.dcp_profile,
                     dump_plans=args.dcp_dump_plans, check_plans=not getattr(args, "dcp_no_check_plans", False),
                     gpus_per_node=(local_world_size() if args.dcp_gpus_per_node is None
                                    else args.dcp_gpus_per_node),
                     seq_length=args.seq_length, log_interval=args.log_interval,
                     plan_ahead=not getattr(args, "dcp_sync_planning", False),
                     train_iters=getattr(args, "train_iters", None),
                     iterations_to_skip=frozenset(getattr(args, "iterations_to_skip", None) or ()),
                     refine=not getattr(args, "dcp_no_refine", False),
                     cp_attention=parse_comma_list(getattr(args, "dcp_cp_attention", None)) or ("allgather",),
                     row_multiple=fp8_row_multiple(args), fp8=getattr(args, "fp8", None) is not None,
                     te_attention=getattr(args, "transformer_impl", None) == "transformer_engine")


def parse_comma_list(value: str | None) -> tuple[str, ...] | None:
    """A comma-list flag (--dcp-recompute, --dcp-cp-attention) as a tuple; None when the flag is not given."""
    return tuple(a.strip() for a in value.split(",") if a.strip()) if value is not None else None


def local_world_size() -> int | None:
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value and value.isdigit() and int(value) > 0 else None


def check_gpus_per_node(gpus_per_node: int | None, *, flag: str = "--dcp-gpus-per-node") -> None:
    """Ranks per node must describe this job: >= 1, torchrun's LOCAL_WORLD_SIZE where torchrun says it, else a
    divisor of the world size (the planner prices a CP group inside a node at NVLink bandwidth)."""
    if gpus_per_node is None:
        return
    if gpus_per_node < 1:
        raise DcpUsageError(f"{flag} must be >= 1 (ranks per node), got {gpus_per_node}")
    local_size, world_size = local_world_size(), int(os.environ.get("WORLD_SIZE", "0") or 0)
    if local_size is not None and gpus_per_node != local_size:
        raise DcpUsageError(f"{flag} {gpus_per_node} does not describe this job: torchrun runs {local_size} ranks "
                            f"per node (LOCAL_WORLD_SIZE); give {local_size}, or leave the flag out")
    if local_size is None and world_size > 0 and world_size % gpus_per_node:
        raise DcpUsageError(f"{flag} {gpus_per_node} does not describe this job: the world of {world_size} ranks "
                            f"is not a whole number of nodes of {gpus_per_node}")


def refuse_conflicting_flags(args: argparse.Namespace) -> None:
    """Before Megatron's own validation: --dcp* flags without --dcp, and flags --dcp cannot honour."""
    given = [f"--{name.replace('_', '-')}" for name, value in vars(args).items()
             if name.startswith("dcp_") and value not in (None, False)]
    if not getattr(args, "dcp", False):
        if given:
            raise DcpUsageError(f"{', '.join(given)} only take effect with --dcp")
        return
    refusals = (
        (args.context_parallel_size > 1,
         f"--context-parallel-size {args.context_parallel_size} conflicts with --dcp: DCP chooses the CP size of "
         "every document per step (Megatron's own CP stays 1); cap it with --dcp-max-cp-size"),
        (getattr(args, "hybrid_context_parallel", False),
         "--hybrid-context-parallel is Megatron's own per-batch CP scheduler; use it or --dcp, not both"),
        (args.recompute_granularity is not None,
         f"--recompute-granularity {args.recompute_granularity} conflicts with --dcp: DCP chooses recompute per "
         "micro-batch; restrict its choices with --dcp-recompute"),
        (args.attention_dropout > 0,
         f"--attention-dropout {args.attention_dropout} is not supported by DCP's context-parallel attention; use 0"),
        (args.micro_batch_size != 1 and not args.dataloader_inter_document_masking,
         "--dcp packs documents into its own micro-batches: with --micro-batch-size > 1 it needs "
         "--dataloader-inter-document-masking so documents keep their boundaries"),
    )
    for refused, message in refusals:
        if refused:
            raise DcpUsageError(message)
    if getattr(args, "dcp_check_plans", False) and getattr(args, "dcp_no_check_plans", False):
        raise DcpUsageError("--dcp-check-plans and --dcp-no-check-plans contradict each other: give one (the check "
                            "is on by default)")
    from dcp_megatron.megatron.layout_checks import check_dcp_layout
    check_dcp_layout(args)   # pipeline depth, virtual stages, MoE
    if not args.calculate_per_token_loss:
        # Ranks run different numbers of micro-batches: only a per-token loss (global sum / global
        # token count) gives the gradient of the whole global batch.
        args.calculate_per_token_loss = True
        if int(os.environ.get('RANK', getattr(args, 'rank', 0) or 0)) == 0:
            print("dcp: --dcp turns on --calculate-per-token-loss (ranks run different micro-batch counts; "
                  "the loss is the global batch's token mean)", flush=True)


def validate_dcp_args(args: argparse.Namespace) -> None:
    """After Megatron's validation (data-parallel size known): every check, and --dcp's per-token loss."""
    refuse_conflicting_flags(args)
    check_gpu_path(args)   # FP8 recipes, apex's fusion kernel, the row alignment (gpu_checks.py)
    if not getattr(args, "dcp", False):
        return
    if args.dcp_profile is not None and not os.path.isfile(args.dcp_profile):
        raise DcpUsageError(f"--dcp-profile {args.dcp_profile}: "
                            f"{'is a directory; give the profile JSON file' if os.path.isdir(args.dcp_profile) else 'no such file'}")
    check_gpus_per_node(args.dcp_gpus_per_node)
    if args.dcp_cp_attention is not None and "ulysses" in args.dcp_cp_attention:
        raise DcpUsageError("--dcp-cp-attention ulysses: the Ulysses CP flavour runs under DeepSpeed "
                            "(pretrain_scripts/pretrain_gpt_deepspeed.py) only; Megatron-LM's get_batch hands "
                            "attention a CP group per micro-batch but no flavour")
    if args.dcp_max_cp_size is not None and args.dcp_max_cp_size > args.data_parallel_size:
        raise DcpUsageError(f"--dcp-max-cp-size {args.dcp_max_cp_size} exceeds the DCP domain of "
                         f"{args.data_parallel_size} ranks (world size / (TP x PP))")
    timeout_minutes = getattr(args, "distributed_timeout_minutes", None)
    if timeout_minutes is not None and not timeout_minutes > 0:
        raise DcpUsageError(f"--distributed-timeout-minutes must be positive, got {timeout_minutes}")
    dcp_config_from_args(args)  # the remaining value checks live in DcpConfig
    if args.dcp_profile_out is not None or args.dcp_profile_report is not None:
        profile_config_from_args(args)


def profile_config_from_args(args: argparse.Namespace):
    """The ProfileConfig of a `dcp-profile` run (DcpUsageError for flags it cannot honour)."""
    from dcp_megatron.megatron.profiler import ProfileConfig

    for flag, path in (("--dcp-profile-out", args.dcp_profile_out), ("--dcp-profile-report", args.dcp_profile_report)):
        if path is not None:
            parent = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(parent) or os.path.isdir(path):
                raise DcpUsageError(f"{flag} {path}: {'is a directory' if os.path.isdir(path) else 'no such directory ' + parent}")
    if args.dcp_profile_report is not None and args.dcp_profile_out is None:
        raise DcpUsageError("--dcp-profile-report needs --dcp-profile-out")
    if args.pipeline_model_parallel_size != 1:
        raise DcpUsageError("the profiler runs one pipeline stage: give --pipeline-model-parallel-size 1 and "
                            "--num-layers = the training run's layers per stage")
    trained = args.dcp_profile_scale_to_layers or args.num_layers
    if trained < args.num_layers:
        raise DcpUsageError(f"--dcp-profile-scale-to-layers {trained} is below the profiled --num-layers "
                            f"{args.num_layers}")
    try:
        return ProfileConfig(out=args.dcp_profile_out, report=args.dcp_profile_report,
                             repeats=3 if args.dcp_profile_repeats is None else args.dcp_profile_repeats,
                             trained_layers=trained, clock=args.dcp_profile_clock or "cpu")
    except ValueError as err:
        raise DcpUsageError(str(err)) from None


def check_plannable(args: argparse.Namespace) -> None:
    """After validate_dcp_args, before any process group: the --dcp-profile reads as a profile, and a
    --seq-length document fits the domain under the memory budget (else the flags to change are named)."""
    if not getattr(args, "dcp", False) or getattr(args, "dcp_profile_out", None):
        return   # (a profiling run plans nothing: the training run's budget does not bind it)
    import torch

    from dcp_megatron.megatron.planning import checked_cost_model, model_shape_from_args

    vocab_size = getattr(args, "padded_vocab_size", None)
    if vocab_size is None and getattr(args, "vocab_size", None):   # padded as Megatron's tokenizer set-up does
        multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
        vocab_size = -(-args.vocab_size // multiple) * multiple
    if vocab_size is None:
        return   # a tokenizer's vocabulary is known once Megatron builds it; the first step checks then
    checked_cost_model(dcp_config_from_args(args), model_shape_from_args(args, vocab_size=vocab_size),
                       domain_size=args.data_parallel_size, has_gpu=torch.cuda.is_available())
