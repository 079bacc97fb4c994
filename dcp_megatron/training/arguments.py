"""The checks of a megatron.training run's `--dcp*` flags against the rest of Megatron's.

The flags themselves are dcp_megatron/flags/dcp_flags.py (both engines parse them). `validate_dcp_args(args)` runs after
Megatron's own `validate_args`: it refuses combinations DCP cannot honour, with the reason and the flag to
change, before any model is built. Everything downstream gets only `DcpConfig`, never Megatron's whole `args`.
"""
from __future__ import annotations

import argparse
import os

from dcp_megatron.config import DcpUsageError, check_gpus_per_node
from dcp_megatron.flags.dcp_flags import dcp_config_from_args
from dcp_megatron.flags.fp8_checks import DeviceFacts
from dcp_megatron.training.checks.gpu_checks import check_gpu_path
from dcp_megatron.training.checks.offload_checks import check_offload
from dcp_megatron.training.checks.recompute_checks import check_megatron_recompute


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
        (args.attention_dropout > 0,
         f"--attention-dropout {args.attention_dropout} is not supported by DCP's context-parallel attention; use 0"),
        (args.micro_batch_size != 1 and not args.dataloader_inter_document_masking,
         "--dcp packs documents into its own micro-batches: with --micro-batch-size > 1 it needs "
         "--dataloader-inter-document-masking so documents keep their boundaries"),
    )
    for refused, message in refusals:
        if refused:
            raise DcpUsageError(message)
    check_megatron_recompute(args)   # Megatron's run-wide recompute flags: DCP's switches would override them
    if getattr(args, "dcp_check_plans", False) and getattr(args, "dcp_no_check_plans", False):
        raise DcpUsageError("--dcp-check-plans and --dcp-no-check-plans contradict each other: give one (the check "
                            "is on by default)")
    from dcp_megatron.training.checks.layout_checks import check_dcp_layout
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
    device = DeviceFacts.of_this_machine()
    check_gpu_path(args, device)   # FP8 recipes, apex's fusion kernel, the row alignment (gpu_checks.py)
    if not getattr(args, "dcp", False):
        return
    check_offload(args, device)   # GPU: builds the layers with activation offload; else refused (offload_checks.py)
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
    from dcp_megatron.training.profiler import ProfileConfig

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

    from dcp_megatron.core.planning import checked_cost_model, model_shape_from_args

    vocab_size = getattr(args, "padded_vocab_size", None)
    if vocab_size is None and getattr(args, "vocab_size", None):   # padded as Megatron's tokenizer set-up does
        multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
        vocab_size = -(-args.vocab_size // multiple) * multiple
    if vocab_size is None:
        return   # a tokenizer's vocabulary is known once Megatron builds it; the first step checks then
    checked_cost_model(dcp_config_from_args(args), model_shape_from_args(args, vocab_size=vocab_size),
                       domain_size=args.data_parallel_size, has_gpu=torch.cuda.is_available())
