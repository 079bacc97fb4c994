"""The DeepSpeed script's flags: Megatron's own parser and checks, plus `--deepspeed-config`.

A user moves between the engines with one flag set: the model, data (`--data-path` blends, `--split`,
`--mock-data`, `--tokenizer-type`), batch (`--global-batch-size`, `--micro-batch-size`, `--seq-length`),
run (`--train-iters`, `--save`, `--load`, `--save-interval`, `--log-interval`, `--seed`,
`--distributed-timeout-minutes`), learning-rate and weight-decay schedule (`--lr-decay-style`, `--lr-warmup-*`,
`--lr-decay-iters`, `--min-lr`, `--*-weight-decay*`: Megatron's own scheduler on the engine, lr_schedule.py) and
`--dcp*` flags are parsed by megatron.training's parser (with
our `--dcp*` group, dcp_megatron/flags/dcp_flags.py) and checked by Megatron's `validate_args`.
DeepSpeed adds `--deepspeed-config` (its JSON owns the ZeRO stage, precision, optimizer, clipping and, without
Megatron's schedule flags, the scheduler) and `--override-optimizer-config`.

What the DeepSpeed script cannot honour is refused by name (exit 2), never dropped: tensor, pipeline
or context parallelism (DeepSpeed's data-parallel group is the DCP domain), `--use-distributed-optimizer` (the
JSON's ZeRO stage; `--lr`, `--optimizer`, `--adam-*`, `--weight-decay`, `--clip-grad`, `--bf16`/`--fp16` are
written into the JSON: megatron_flags.py), a schedule flag beside the JSON's "scheduler" block (two schedules),
Megatron's `--tensorboard-dir`/`--wandb-*` writers (the JSON's monitor blocks), and `--train-samples` and the
sample-counted schedule flags (the run counts steps), and every other Megatron flag it does not run
(flag_coverage.py: one line naming it). `--exit-interval N` stops after the step N divides, saved first under
--save, as Megatron's loop. Evaluation (`--eval-interval`, `--eval-iters`) runs once either is given (evaluation.py).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from dcp_megatron.config import DcpUsageError
from dcp_megatron.flags.argv import flag_given

# Megatron flags the JSON decides under DeepSpeed (refused when given, with where to put them instead); the
# optimizer, clipping and precision flags are mapped onto the JSON (megatron_flags.py), the schedule flags run
# Megatron's own scheduler (lr_schedule.py).
_JSON_OWNS = ("--use-distributed-optimizer",)
_NOT_RUN = ("--train-samples",)
_EVAL_FLAGS = ("--eval-interval", "--eval-iters")   # evaluation runs once either is given (evaluation.py)
# Megatron's writers are not built under DeepSpeed: its monitor (scalar_writers.py) writes what the JSON enables.
_MONITOR_FLAGS = ("--tensorboard-dir", "--wandb-project", "--wandb-exp-name", "--wandb-save-dir")


def _add_deepspeed_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("DeepSpeed (dcp-megatron's DeepSpeed script)")
    group.add_argument("--deepspeed-config", required=True, help="DeepSpeed JSON (may hold a \"dcp\" block)")
    group.add_argument("--override-optimizer-config", action="store_true",
                       help="on --load, train with the config's optimizer/scheduler settings where they changed")
    group.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # the deepspeed launcher's
    return parser


def megatron_parser() -> argparse.ArgumentParser:
    """megatron.training's parser with the --dcp* group and --deepspeed-config (unpatched Megatron in this process
    or patched: the same parser)."""
    from megatron.training import arguments

    from dcp_megatron.flags.dcp_flags import unwrapped, with_dcp_arguments

    parser = argparse.ArgumentParser(description="GPT pretraining on DeepSpeed (Megatron's flags)", allow_abbrev=False)
    parser = with_dcp_arguments(unwrapped(arguments.add_megatron_arguments))(parser)
    return _add_deepspeed_arguments(parser)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Megatron's args for a DeepSpeed run, validated by Megatron and by us (DcpUsageError: refuse at start)."""
    from megatron.training import arguments

    from dcp_megatron.flags.cpu_defaults import apply_cpu_defaults, cpu_defaults_notice
    from dcp_megatron.flags.flag_checks import check_backend

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = megatron_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as err:   # argparse printed its usage line; a bad flag is a usage error (exit 2)
        if err.code == 0:
            raise
        raise DcpUsageError("the command line above is not valid (see the usage line)") from None
    refuse_unrun_flags(argv, args)
    from dcp_megatron.deepspeed.megatron_flags import given_megatron_flags

    from dcp_megatron.deepspeed.lr_schedule import given_schedule_flags

    args.deepspeed_megatron_flags = given_megatron_flags(argv, args)   # written into the JSON (deepspeed_setup)
    args.deepspeed_schedule_flags = given_schedule_flags(argv)   # Megatron's scheduler on the engine (lr_schedule.py)
    args.deepspeed_evaluate = any(flag_given(argv, flag) for flag in _EVAL_FLAGS)
    args.rank = int(os.environ.get("RANK", 0))
    args.world_size = int(os.environ.get("WORLD_SIZE", 1))
    adopt_config_batch_size(args)
    check_before_megatron(args)   # what Megatron's bare asserts would report without naming the flag
    from dcp_megatron.deepspeed.flag_coverage import refuse_unhonoured_flags

    # every other Megatron flag: honoured or refused by name (after the specific refusals, before the CPU defaults)
    refuse_unhonoured_flags(parser, args, argv)
    args._is_global_batch_size_explicitly_specified = args.global_batch_size is not None
    if not torch.cuda.is_available():
        applied = apply_cpu_defaults(args, argv=argv)
        if applied and args.rank == 0:
            print(cpu_defaults_notice(applied), flush=True)
    check_backend(args, has_gpu=torch.cuda.is_available())   # an explicit nccl without a GPU (flag_checks.py)
    # validate_args deletes --recompute-activations (as granularity selective): kept for the refusal under --dcp
    args.recompute_activations_given = bool(getattr(args, "recompute_activations", False))
    try:
        _unwrapped_validate(arguments)(args, {"tokenizer_type": "NullTokenizer"})
    except AssertionError as err:   # Megatron's checks are bare asserts: name them as a usage error
        raise DcpUsageError(f"Megatron's argument check failed: {err or 'see the traceback above'}") from None
    return args


def adopt_config_batch_size(args: argparse.Namespace) -> None:
    """The JSON's "train_batch_size" and --global-batch-size are one setting (config.batch_size_of_config)."""
    from dcp_megatron.deepspeed.config import batch_size_of_config, load_deepspeed_config

    given = args.global_batch_size
    args.global_batch_size = batch_size_of_config(load_deepspeed_config(args.deepspeed_config),
                                                  global_batch_size=given)
    if given is None and args.global_batch_size is not None and args.rank == 0:
        print(f'the DeepSpeed config\'s "train_batch_size": {args.global_batch_size} is the global batch (as '
              f"--global-batch-size {args.global_batch_size})", flush=True)


def check_before_megatron(args: argparse.Namespace) -> None:
    """Start-up checks that name their flag, before Megatron's validate_args (TP = PP = CP = 1 already checked,
    so the data-parallel size is the world size)."""
    from dcp_megatron.deepspeed.checkpoint import check_checkpoint_paths
    from dcp_megatron.flags.flag_checks import check_unrunnable_flags

    if args.train_iters is None or args.train_iters < 1:
        raise DcpUsageError("give --train-iters N (N >= 1): the DeepSpeed script counts its run in steps")
    if args.global_batch_size is not None and args.global_batch_size % (args.micro_batch_size * args.world_size):
        raise DcpUsageError(f"--global-batch-size {args.global_batch_size} is not a multiple of --micro-batch-size "
                            f"{args.micro_batch_size} x {args.world_size} data-parallel ranks")
    if args.save_interval is not None and not args.save:
        raise DcpUsageError("--save-interval needs --save DIR")
    check_unrunnable_flags(args, has_gpu=torch.cuda.is_available())   # --rampup-batch-size, wandb, yarn on CPU
    if getattr(args, "deepspeed_evaluate", False):   # the validation data is sized as Megatron sizes it
        from dcp_megatron.flags.eval_flags import settle_evaluation_flags

        settle_evaluation_flags(args)
    check_data_paths(args)
    check_checkpoint_paths(save=args.save, load=args.load, dump_plans=args.dcp_dump_plans)


def check_data_paths(args: argparse.Namespace) -> None:
    """At start, before any process group: every --data-path prefix is a .bin/.idx pair that belongs together
    (named first, also beside --mock-data), one data source, and the blends as the Megatron path checks them."""
    from dcp_megatron.flags.data_files import check_data_files, check_indexed_pair

    for prefix in [token for token in args.data_path or [] if not _is_number(token)]:
        check_indexed_pair(prefix, "--data-path")
    has_paths = any(getattr(args, name, None) for name in ("data_path", "train_data_path", "data_args_path",
                                                            "per_split_data_args_path"))
    if bool(args.mock_data) == has_paths:
        raise DcpUsageError("give exactly one of --data-path [WEIGHT] PREFIX ... (or per-split paths) and --mock-data")
    check_data_files(args)


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def _unwrapped_validate(arguments):
    from dcp_megatron.flags.dcp_flags import unwrapped

    return unwrapped(arguments.validate_args)   # ours for the Megatron loop checks Megatron-path flags


def refuse_unrun_flags(argv: list[str], args: argparse.Namespace) -> None:
    owned = [flag for flag in _JSON_OWNS if flag_given(argv, flag)]
    if owned:
        raise DcpUsageError(f"{', '.join(owned)}: under DeepSpeed the --deepspeed-config JSON's ZeRO stage shards the "
                            'optimizer ("zero_optimization": {"stage": 1}); set it there')
    monitor = [flag for flag in _MONITOR_FLAGS if flag_given(argv, flag)]
    if monitor:
        raise DcpUsageError(f"{', '.join(monitor)}: under DeepSpeed the --deepspeed-config JSON's monitor blocks write "
                            'the scalars ("tensorboard": {"enabled": true, "output_path": DIR}, "wandb": {"enabled": '
                            'true, "project": P}); move these settings there')
    unrun = [flag for flag in _NOT_RUN if flag_given(argv, flag)]
    if unrun:
        raise DcpUsageError(f"{', '.join(unrun)}: the DeepSpeed script counts its run in --train-iters steps; give "
                            "--train-iters instead")
    for flag in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        if getattr(args, flag) != 1:
            raise DcpUsageError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: the DeepSpeed script runs "
                                "TP = PP = 1 and lets --dcp choose CP per document; use the Megatron path for TP/PP")
