"""The front door of a megatron.training run: its `--dcp*` flags checked against Megatron's, and its run spec.

The flags themselves are dcp_megatron/flags/dcp_flags.py (both engines parse them). The patched `validate_args`
(patches/training_arguments.py) runs `refuse_conflicting_flags` before Megatron's own checks (flags Megatron's
checks may fail on) and `start_megatron_run` after them (the data-parallel size is known then): the GPU path,
activation offload, the checks both engines share (flags/start_checks.py), the run's `RunSpec` built once, and
whether a --seq-length document can be planned. Every check runs once per start, with the reason and the flag to
change, before any model is built. Everything downstream gets only its part of the spec, never Megatron's `args`.
"""
from __future__ import annotations

import argparse
import os

from dcp_megatron.config import DcpUsageError, RunSpec, parse_comma_list
from dcp_megatron.core.out_of_memory import under_recorded_limit
from dcp_megatron.flags.dcp_flags import dcp_config_from_args
from dcp_megatron.flags.fp8_checks import DeviceFacts
from dcp_megatron.flags.start_checks import MEGATRON, DcpStart, check_dcp_start
from dcp_megatron.training.checks.gpu_checks import check_gpu_path
from dcp_megatron.training.checks.layout_checks import check_dcp_layout
from dcp_megatron.training.checks.offload_checks import check_offload
from dcp_megatron.flags.recompute_flags import check_megatron_recompute


def refuse_conflicting_flags(args: argparse.Namespace) -> None:
    """Before Megatron's own validation, under --dcp: flags --dcp cannot honour (and --dcp's per-token loss)."""
    if not getattr(args, "dcp", False):
        return   # (--dcp* flags without --dcp: the shared start checks, after Megatron's)
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
    for name in ("memory_refine", "memory_probe"):
        if getattr(args, f"dcp_{name}", False) and getattr(args, f"dcp_no_{name}", False):
            flag = name.replace("_", "-")
            raise DcpUsageError(f"--dcp-{flag} and --dcp-no-{flag} contradict each other: give one (on by default "
                                "on GPU)")
    check_dcp_layout(args)   # pipeline depth, virtual stages, MoE
    if not args.calculate_per_token_loss:
        # Ranks run different numbers of micro-batches: only a per-token loss (global sum / global
        # token count) gives the gradient of the whole global batch.
        args.calculate_per_token_loss = True
        if int(os.environ.get('RANK', getattr(args, 'rank', 0) or 0)) == 0:
            print("dcp: --dcp turns on --calculate-per-token-loss (ranks run different micro-batch counts; "
                  "the loss is the global batch's token mean)", flush=True)


def dcp_start_of(args: argparse.Namespace, *, has_gpu: bool) -> DcpStart:
    """What the shared start checks read of a megatron.training run's flags."""
    dcp = bool(getattr(args, "dcp", False))
    given = tuple(f"--{name.replace('_', '-')}" for name, value in vars(args).items()
                  if name.startswith("dcp_") and value not in (None, False))
    settings = {"profile": args.dcp_profile, "gpus_per_node": args.dcp_gpus_per_node,
                "cp_attention": parse_comma_list(args.dcp_cp_attention), "max_cp_size": args.dcp_max_cp_size}
    # without --dcp Megatron's own timeout handling stands
    timeout_minutes = getattr(args, "distributed_timeout_minutes", None) if dcp else None
    return DcpStart(wording=MEGATRON, enabled=dcp, given=given, settings=settings,
                    domain_size=getattr(args, "data_parallel_size", None), timeout_minutes=timeout_minutes,
                    has_gpu=has_gpu)


def start_megatron_run(args: argparse.Namespace) -> RunSpec | None:
    """After Megatron's validation: the remaining start-up checks, each once, and the run's spec (None without
    --dcp), built once from the checked flags."""
    device = DeviceFacts.of_this_machine()
    check_gpu_path(args, device)   # FP8 recipes, apex's fusion kernel, the row alignment (gpu_checks.py)
    if getattr(args, "dcp", False):
        check_megatron_recompute(args)   # again, on the flags as validate_args left them (--recompute-activations)
        check_offload(args, device)   # GPU: builds the layers with activation offload; else refused (offload_checks.py)
    check_dcp_start(dcp_start_of(args, has_gpu=device.has_gpu))
    if not getattr(args, "dcp", False):
        return None
    profile = None
    if args.dcp_profile_out is not None or args.dcp_profile_report is not None:
        profile = profile_config_from_args(args)
    # a micro-batch that ran out of memory in an earlier run of this job: plan under its count (out_of_memory.py)
    dcp, note = under_recorded_limit(dcp_config_from_args(args),   # DcpConfig holds the value checks
                                     getattr(args, "load", None), getattr(args, "save", None))
    if note and getattr(args, "rank", 0) == 0:
        print(note, flush=True)
    spec = RunSpec(dcp=dcp,
                   timeout_minutes=getattr(args, "distributed_timeout_minutes", None), profile=profile)
    from dcp_megatron.runtime.device_memory import cap_for_run

    cap_for_run(dcp.device_memory_gb, has_gpu=device.has_gpu,   # before the model: torch's allocator capped there
                say=(lambda line: print(line, flush=True)) if getattr(args, "rank", 0) == 0 else None)
    check_plannable(args, spec)
    return spec


def validate_dcp_args(args: argparse.Namespace) -> RunSpec | None:
    """Every --dcp start-up check of a megatron.training run in the order a start runs them (the patched
    validate_args runs the two halves around Megatron's own checks), and the run spec."""
    refuse_conflicting_flags(args)
    return start_megatron_run(args)


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


def check_plannable(args: argparse.Namespace, spec: RunSpec) -> None:
    """Before any process group: the --dcp-profile reads as a profile, and a --seq-length document fits the
    domain under the memory budget (else the flags to change are named)."""
    if getattr(args, "dcp_profile_out", None):
        return   # (a profiling run plans nothing: the training run's budget does not bind it)
    import torch

    from dcp_megatron.core.planning import checked_cost_model, model_shape_from_args

    vocab_size = getattr(args, "padded_vocab_size", None)
    if vocab_size is None and getattr(args, "vocab_size", None):   # padded as Megatron's tokenizer set-up does
        multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
        vocab_size = -(-args.vocab_size // multiple) * multiple
    if vocab_size is None:
        return   # a tokenizer's vocabulary is known once Megatron builds it; the first step checks then
    checked_cost_model(spec.dcp, model_shape_from_args(args, vocab_size=vocab_size),
                       domain_size=args.data_parallel_size, has_gpu=torch.cuda.is_available())
