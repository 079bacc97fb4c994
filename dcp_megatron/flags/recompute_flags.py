"""Megatron's own recompute flags under `--dcp`: refused at start, with the `--dcp-recompute` that says the same.

Under --dcp each micro-batch's recompute is switched onto the layers just before its forward
(dcp_megatron/core/recompute.py): granularity, method, layer count and the module flags are the plan's, so
Megatron's run-wide `--recompute-granularity`, `--recompute-modules`, `--recompute-method`,
`--recompute-num-layers`, `--moe-layer-recompute` and `--recompute-activations` (Megatron's validate_args turns
it into `--recompute-granularity selective`) would be overridden without a word. Each is refused (one line, naming
the flag) with the `--dcp-recompute` menu that lets the planner choose that relief. The check runs before
Megatron's validate_args (whose own recompute assertions are bare) and again after it, on the flags as the engine
reads them; the DeepSpeed script runs it on its validated flags once DCP is on (deepspeed/setup.py). Under
EP > 1 `moe` recompute is off (a replay reruns the MoE all-to-alls on the recomputing ranks only,
training/checks/layout_checks.py), so `--moe-layer-recompute` has no equivalent there, and the line says so.
"""
from __future__ import annotations

import argparse

from dcp_megatron.config import RECOMPUTE_CHOICES, DcpUsageError

_EP_REPLAYS = ("full", "moe")   # kinds training/checks/layout_checks._without_full_recompute takes out under EP > 1


def check_megatron_recompute(args: argparse.Namespace) -> None:
    """Under --dcp: refuse (DcpUsageError) each of Megatron's recompute flags given (module docstring)."""
    # validate_args turns --recompute-activations into granularity selective and deletes it; the DeepSpeed script
    # keeps what was given (arguments.py) so the line names the flag the user wrote
    if getattr(args, "recompute_activations", False) or getattr(args, "recompute_activations_given", False):
        raise DcpUsageError(_refusal(args, "--recompute-activations", ["selective"],
                                     what="recompute (Megatron's flag means selective)"))
    granularity = getattr(args, "recompute_granularity", None)
    if granularity is not None:
        raise DcpUsageError(_refusal(args, f"--recompute-granularity {granularity}", [granularity],
                                     what="recompute"))
    modules = list(getattr(args, "recompute_modules", None) or [])
    if modules:
        raise DcpUsageError(_refusal(args, f"--recompute-modules {' '.join(modules)}", modules))
    for flag, name in (("--recompute-method", "recompute_method"), ("--recompute-num-layers", "recompute_num_layers")):
        value = getattr(args, name, None)
        if value is not None:
            raise DcpUsageError(_refusal(args, f"{flag} {value}", ["full"], what="full recompute of k layers"))
    if getattr(args, "moe_layer_recompute", False):
        raise DcpUsageError(_refusal(args, "--moe-layer-recompute", ["moe"]))


def _refusal(args: argparse.Namespace, given: str, kinds: list[str], *, what: str = "module recompute") -> str:
    """The one line for `given`: DCP's menu holding `kinds` (with "none", so the planner may also not recompute)."""
    head = f"{given} conflicts with --dcp: DCP chooses {what} per micro-batch (the flag would be overridden)"
    unknown = [kind for kind in kinds if kind not in RECOMPUTE_CHOICES]
    if unknown:
        return (f"{head}; --dcp-recompute has no {', '.join(unknown)}: drop {given.split()[0]} and choose from "
                f"{','.join(RECOMPUTE_CHOICES)} with --dcp-recompute")
    ep = getattr(args, "expert_model_parallel_size", 1) or 1
    replaying = [kind for kind in kinds if kind in _EP_REPLAYS] if getattr(args, "num_experts", None) and ep > 1 \
        else []
    off = (f"--dcp-recompute {','.join(replaying)} is off under --expert-model-parallel-size {ep} (a replay would "
           "rerun the MoE all-to-alls on the recomputing ranks only)")
    rest = [kind for kind in kinds if kind not in replaying]
    if replaying and not rest:
        return f"{head}; its equivalent {off}: drop {given.split()[0]}"
    return f"{head}; give --dcp-recompute none,{','.join(rest)} instead" + (f" ({off})" if replaying else "")
