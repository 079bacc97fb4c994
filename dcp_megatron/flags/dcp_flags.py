"""The `--dcp*` flags in Megatron's argument parser and the run's `DcpConfig` built from them.

Both engines parse Megatron's own flags: a megatron.training run through Megatron's parser (with this group added
by patches/training_arguments.py), the DeepSpeed script through `megatron_parser()` (Megatron's parser, this group,
and its own flags). Everything downstream gets only the `DcpConfig`, never Megatron's whole `args`.
"""
from __future__ import annotations

import argparse

from dcp_megatron.config import (DCP_POLICIES, DEFAULT_RECOMPUTE, RECOMPUTE_CHOICES, DcpConfig, local_world_size,
                                 parse_comma_list)
from dcp_megatron.flags.fp8_checks import fp8_row_multiple

# What a patch that wraps an upstream function leaves on the wrapper: the function it wraps (patches/registry.py).
WRAPPED_ATTR = "dcp_original"


def unwrapped(function):
    """An upstream function as it was before our patches (itself when not wrapped)."""
    return getattr(function, WRAPPED_ATTR, function)


def with_dcp_arguments(add_megatron_arguments):
    """Megatron's `add_megatron_arguments` followed by the `--dcp*` group (and fractional minutes)."""
    def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser = add_megatron_arguments(parser)
        for action in parser._actions:
            # Ints upstream; timedelta(minutes=...) and the loop's `train_time > args.exit_duration_in_mins`, where
            # they are used, take floats: 0.5 finds a stopped rank in 30 s (tests, debugging) where the smallest whole
            # value waits a minute, and an exit after 0.01 minutes lands at a known step.
            if {"--distributed-timeout-minutes", "--exit-duration-in-mins"} & set(action.option_strings):
                action.type = float
        return add_dcp_arguments(parser)

    return add_arguments


def add_dcp_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("data-centric parallelism (dcp-megatron)")
    group.add_argument("--dcp", action="store_true",
                       help="plan each global batch: CP size per document, micro-batches per rank, recompute")
    group.add_argument("--dcp-policy", choices=DCP_POLICIES, default=None, help="planner policy (default: dcp)")
    group.add_argument("--dcp-policy-setting", default=None, metavar="JSON",
                       help='a baseline policy\'s run-wide setting, e.g. {"token_cap": 4096, "min_cp_size": 1, '
                            '"recompute": "none"} for megatron-dynamic / megatron-hybrid, {"cp_size": 2, '
                            '"recompute": {"full_layers": 2}} for static (default: the policy\'s own)')
    group.add_argument("--dcp-max-cp-size", type=int, default=None, help="largest CP group a document may use")
    group.add_argument("--dcp-memory-budget-gb", type=float, default=None,
                       help="memory per rank the planner may fill (GiB; default on GPU: the device's, read at start, "
                            "docs/gpu.md; on CPU the cluster preset's); real bytes on "
                            "GPU and on a CPU run (fp32, --transformer-impl local: costmodel/memory_spec.py CPU_FP32)")
    group.add_argument("--dcp-device-memory-gb", type=float, default=None, metavar="G",
                       help="the device memory this run may use (GiB): on GPU torch's allocator is capped there; "
                            "without a GPU an emulated device counts every live tensor byte and the allocation past "
                            "it raises an out-of-memory error, as a GPU would (runtime/device_ceiling.py; slows each "
                            "operator). The default --dcp-memory-budget-gb derives from it (default: the device read "
                            "at start, docs/gpu.md)")
    group.add_argument("--dcp-recompute", default=None,
                       help="comma list of the memory reliefs the planner may choose per micro-batch, from "
                       f"{','.join(RECOMPUTE_CHOICES)} (default {','.join(DEFAULT_RECOMPUTE)}; core_attn, mlp, "
                       "layernorm, moe_act, moe: megatron-core's recompute_modules; selective: core_attn; full: "
                       "the fewest whole layers)")
    group.add_argument("--dcp-profile", default=None, help="measured profile JSON overriding the cost model")
    group.add_argument("--dcp-dump-plans", default=None, metavar="DIR", help="write each step's plan JSON to DIR")
    group.add_argument("--dcp-gpus-per-node", type=int, default=None,
                       help="ranks per node, for the planner's intra- vs inter-node bandwidth (default: torchrun's "
                            "LOCAL_WORLD_SIZE)")
    group.add_argument("--dcp-sync-planning", action="store_true",
                       help="plan each step on the training thread when it starts (default: plan it while the "
                            "previous step trains, one step ahead)")
    group.add_argument("--dcp-plan-part-ranks", type=int, default=None, metavar="N",
                       help="plan the DCP domain in parts of N ranks (whole nodes), each rank planning its own part "
                            "and gathering the others' (0: every rank plans the whole domain; default: parts of "
                            "1024 ranks from domains of 8192 on; PP 1, EP 1 and ZeRO below 3 only)")
    group.add_argument("--dcp-no-refine", action="store_true",
                       help="keep the cost model as given (default: correct it every step from measured "
                            "micro-batch times; PP 1 only)")
    group.add_argument("--dcp-memory-refine", action="store_true",
                       help="correct the memory count from each micro-batch's measured bytes in the first steps "
                            "(default on GPU; on CPU, saved-for-backward bytes)")
    group.add_argument("--dcp-no-memory-refine", action="store_true", help="keep the memory count as counted")
    group.add_argument("--dcp-memory-refine-steps", type=int, default=None, metavar="N",
                       help="the first N steps measure each micro-batch's memory (default 5)")
    group.add_argument("--dcp-memory-probe", action="store_true",
                       help="before step 1, run the largest micro-batch of each relief once and correct the memory "
                            "count from it (default on GPU)")
    group.add_argument("--dcp-no-memory-probe", action="store_true", help="no memory probe before step 1")
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
    # fault injection and diagnostics (docs/reliability.md)
    group.add_argument("--dcp-inject-out-of-memory-at", default=None, metavar="ITERATION:RANK:MICROBATCH",
                       help="fault injection: raise an out-of-memory when global rank RANK takes micro-batch "
                            "MICROBATCH (0-based, plan order) of ITERATION, to test the out-of-memory handling")
    group.add_argument("--dcp-dump-saved-bytes", default=None, metavar="DIR",
                       help="diagnostics: append each micro-batch's measured saved-for-backward bytes to "
                            "DIR/saved_bytes_rank<R>.jsonl (megatron.training path)")
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


def policy_setting_from_flag(text: str | None, policy: str | None):
    """--dcp-policy-setting's JSON as the policy's StaticSetting / DynamicSetting (None when not given; with no
    policy, the kind its keys name: DcpConfig then checks it against the policy); DcpUsageError naming the flag
    for bad JSON, wrong keys or values, or a policy that takes no setting."""
    import json

    from dcp_megatron.config import DcpUsageError
    from dcp_megatron.planner.baselines.settings import setting_from_json

    if text is None:
        return None
    try:
        return setting_from_json(json.loads(text), policy)
    except ValueError as err:   # (json.JSONDecodeError is one)
        raise DcpUsageError(f"--dcp-policy-setting {text}: {err}") from None


def dcp_flag_settings(args: argparse.Namespace) -> dict:
    """The --dcp* flags as DcpConfig keyword arguments, None where a flag was not given: the one mapping of both
    engines (megatron.training: `dcp_config_from_args`; DeepSpeed: over the JSON's "dcp" block, deepspeed/config.py)."""
    no_check_plans = getattr(args, "dcp_no_check_plans", False)
    return {"policy": args.dcp_policy,
            "policy_setting": policy_setting_from_flag(getattr(args, "dcp_policy_setting", None), args.dcp_policy),
            "max_cp_size": args.dcp_max_cp_size, "memory_budget_gb": args.dcp_memory_budget_gb,
            "device_memory_gb": getattr(args, "dcp_device_memory_gb", None),
            "recompute": parse_comma_list(args.dcp_recompute), "profile": args.dcp_profile,   # (DcpConfig checks it)
            "dump_plans": args.dcp_dump_plans,
            "check_plans": False if no_check_plans else (True if getattr(args, "dcp_check_plans", False) else None),
            "gpus_per_node": args.dcp_gpus_per_node,
            "plan_ahead": False if getattr(args, "dcp_sync_planning", False) else None,
            "plan_part_ranks": getattr(args, "dcp_plan_part_ranks", None),
            "refine": False if getattr(args, "dcp_no_refine", False) else None,
            "memory_refine": _on_off(args, "dcp_memory_refine", "dcp_no_memory_refine"),
            "memory_refine_steps": getattr(args, "dcp_memory_refine_steps", None),
            "memory_probe": _on_off(args, "dcp_memory_probe", "dcp_no_memory_probe"),
            "cp_attention": parse_comma_list(getattr(args, "dcp_cp_attention", None)),
            "inject_out_of_memory_at": injection_point(getattr(args, "dcp_inject_out_of_memory_at", None)),
            "dump_saved_bytes": getattr(args, "dcp_dump_saved_bytes", None)}


def injection_point(text: str | None) -> tuple[int, int, int] | None:
    """--dcp-inject-out-of-memory-at ITERATION:RANK:MICROBATCH as three integers (None when not given)."""
    from dcp_megatron.config import DcpUsageError

    if text is None:
        return None
    try:
        iteration, rank, index = (int(part) for part in text.split(":"))
    except ValueError:
        raise DcpUsageError(f"--dcp-inject-out-of-memory-at {text}: give ITERATION:RANK:MICROBATCH (three integers, "
                            "e.g. 3:0:1)") from None
    if iteration < 1 or rank < 0 or index < 0:
        raise DcpUsageError(f"--dcp-inject-out-of-memory-at {text}: ITERATION counts from 1, RANK and MICROBATCH "
                            "from 0")
    return iteration, rank, index


def _on_off(args: argparse.Namespace, on: str, off: str) -> bool | None:
    """A pair of --x / --no-x flags: True, False, or None when neither was given (the run's default)."""
    if getattr(args, off, False):
        return False
    return True if getattr(args, on, False) else None


def dcp_config_from_args(args: argparse.Namespace) -> DcpConfig:
    """A megatron.training run's DcpConfig: its --dcp* flags, the defaults where not given, and what Megatron's
    own flags say of the run (sequence length, steps, FP8, attention implementation, activation offload)."""
    given = {key: value for key, value in dcp_flag_settings(args).items() if value is not None}
    defaults = {"policy": "dcp", "recompute": DEFAULT_RECOMPUTE, "gpus_per_node": local_world_size(),
                "cp_attention": ("allgather",)}
    return DcpConfig(**{**defaults, **given},
                     seq_length=args.seq_length, log_interval=args.log_interval,
                     train_iters=getattr(args, "train_iters", None),
                     iterations_to_skip=frozenset(getattr(args, "iterations_to_skip", None) or ()),
                     row_multiple=fp8_row_multiple(args), fp8=getattr(args, "fp8", None) is not None,
                     te_attention=getattr(args, "transformer_impl", None) == "transformer_engine",
                     # set where the layers are built with it (training/checks/offload_checks.py, GPU only)
                     offload_runs=bool(getattr(args, "fine_grained_activation_offloading", False)))
