"""Megatron's flags a run needs on a machine without a GPU, set unless the user gave them.

Megatron's defaults assume a GPU: `--distributed-backend nccl` dies with "ProcessGroupNCCL is only
supported with GPUs", the Transformer Engine layer spec and the fused kernels need CUDA. Without a GPU
a run gets the flags that run on CPU (docs/megatron.md) and says so in one line; a flag the user gave
explicitly (found on the command line, e.g. `--transformer-impl transformer_engine`) is kept as given.
Both scripts use it: the Megatron path from the `validate_args` patch (patches/training_arguments.py,
so the launcher and Megatron-LM's own scripts get it too), the DeepSpeed script after its parse.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class CpuDefault:
    flag: str        # the option as a user types it
    dest: str        # its attribute on Megatron's args
    value: object    # what a CPU run needs
    shown: str       # how the one-line notice names it

    def given_in(self, argv: list[str]) -> bool:
        return any(token == self.flag or token.startswith(self.flag + "=") for token in argv)


CPU_DEFAULTS = (
    CpuDefault(flag="--distributed-backend", dest="distributed_backend", value="gloo",
               shown="--distributed-backend gloo"),
    CpuDefault(flag="--transformer-impl", dest="transformer_impl", value="local", shown="--transformer-impl local"),
    CpuDefault(flag="--use-cpu-initialization", dest="use_cpu_initialization", value=True,
               shown="--use-cpu-initialization"),
    CpuDefault(flag="--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion", value=False,
               shown="--no-gradient-accumulation-fusion"),
    CpuDefault(flag="--no-masked-softmax-fusion", dest="masked_softmax_fusion", value=False,
               shown="--no-masked-softmax-fusion"),
    CpuDefault(flag="--no-bias-gelu-fusion", dest="bias_gelu_fusion", value=False, shown="--no-bias-gelu-fusion"),
    CpuDefault(flag="--no-bias-dropout-fusion", dest="bias_dropout_fusion", value=False,
               shown="--no-bias-dropout-fusion"),
    CpuDefault(flag="--no-rope-fusion", dest="apply_rope_fusion", value=False, shown="--no-rope-fusion"),
    CpuDefault(flag="--no-persist-layer-norm", dest="no_persist_layer_norm", value=True,
               shown="--no-persist-layer-norm"),
)


def apply_cpu_defaults(args: argparse.Namespace, *, argv: list[str]) -> list[str]:
    """Set every CPU default the user did not give on `argv` and whose value differs; the flags set, as shown."""
    applied = []
    for default in CPU_DEFAULTS:
        if default.given_in(argv) or getattr(args, default.dest, default.value) == default.value:
            continue
        setattr(args, default.dest, default.value)
        applied.append(default.shown)
    return applied


def cpu_defaults_notice(applied: list[str]) -> str:
    return (f"dcp: no GPU found, so this run uses {' '.join(applied)} (Megatron's defaults need a GPU; "
            "give any of these flags to choose otherwise)")
