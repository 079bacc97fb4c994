"""Patches for `megatron.training.arguments`: the `--dcp*` flags in Megatron's own parser and checks.

- `add_megatron_arguments` builds Megatron's parser for every script on megatron.training; after
  it, our argument group is added (dcp_megatron/training/arguments.py). A script's own
  `extra_args_provider` is untouched, so zero lines change in the user's script. Megatron's
  `--distributed-timeout-minutes` and `--exit-duration-in-mins` also take fractions of a minute (upstream:
  whole minutes only).
- `validate_args` runs Megatron's checks between ours: without a GPU, the CPU flags first unless the
  user gave them (dcp_megatron/flags/cpu_defaults.py: Megatron's GPU defaults die at init on CPU), and
  the evaluation flags 0.19.2 fails on or ignores (dcp_megatron/flags/eval_flags.py);
  then flag conflicts (`refuse_conflicting_flags`, so e.g. `--context-parallel-size 2` is refused
  before Megatron sets CP up), the rest after (`start_megatron_run`, which also builds the run's spec once and
  hands it to the loop's patches through the set's `RunSpecSlot`): a flag DCP cannot honour stops the run at
  start-up with the reason, before any model is built; `check_run_paths` (dcp_megatron/training/checks/run_paths.py) does the same for a
  `--save`/`--tensorboard-dir`/`--dcp-dump-plans` that cannot be written and a `--load` with nothing to
  resume from, which upstream finds only when it first saves, or only warns about; a second run on one
  `--save` (a lock); before Megatron's checks, mistakes it meets with bare assertions, named by flag
  (flag_checks.py); after them, the corpus (data_files.py: blend weights, .bin against .idx). A refusal
  ends the process with one line and exit status 2 (refusal.py), whichever way the run was started.

CPU shim (no GPU only): with TP or CP > 1, `validate_args` asks `get_device_arch_version()`
(imported by name) for the GPU generation, which calls into CUDA and fails without a driver.
On CPU it answers 9 (Hopper, the H200s our users run), so validation takes the same path as there
(e.g. it requires CUDA_DEVICE_MAX_CONNECTIONS=1 with TP > 1).
"""
from __future__ import annotations

import functools
import importlib

from patches import MEGATRON_CORE_VERSIONS
from patches.registry import Patch
from dcp_megatron.flags.dcp_flags import unwrapped

_MODULE = "megatron.training.arguments"


def _with_dcp_arguments(original):
    from dcp_megatron.flags.dcp_flags import with_dcp_arguments

    add_megatron_arguments = functools.wraps(original)(with_dcp_arguments(original))
    add_megatron_arguments.dcp_original = original
    return add_megatron_arguments


def _with_dcp_validation(original, specs=None):
    """`specs`: the RunSpecSlot that hands the spec this start builds to the loop's patches (training_training.py)."""
    @functools.wraps(original)
    def validate_args(args, defaults={}):  # noqa: B006 - Megatron's own signature
        from dcp_megatron.flags.data_files import check_data_files
        from dcp_megatron.flags.eval_flags import settle_evaluation_flags
        from dcp_megatron.config import DcpUsageError
        from dcp_megatron.training.arguments import refuse_conflicting_flags, start_megatron_run
        from dcp_megatron.flags.flag_checks import check_megatron_flags
        from dcp_megatron.training.checks.moe_checks import check_moe_dispatcher
        from dcp_megatron.flags.refusal import exit_refused
        from dcp_megatron.training.checks.run_paths import check_run_paths

        try:
            _cpu_defaults(args)  # before Megatron's checks, which would take the GPU defaults
            settle_evaluation_flags(args)  # an --eval-interval 0.19.2 would divide by; a --split mock data ignores
            refuse_conflicting_flags(args)  # first: Megatron's own checks may fail on what we refuse
            check_megatron_flags(args)      # mistakes Megatron meets with bare assertions, named by flag
            check_moe_dispatcher(args)      # a token dispatcher this machine cannot run (moe_checks.py)
            result = original(args, defaults)
            spec = start_megatron_run(args)   # the rest, each once; the run spec, built once (None without --dcp)
            check_data_files(args)  # blend weights, every .bin against its .idx (upstream never compares them)
            check_run_paths(args)  # every run: Megatron would find a bad --save only when it first saves
            if spec is not None and specs is not None:
                specs.hold(args, spec)
        except DcpUsageError as err:
            exit_refused(err)   # one line, exit 2, also under plain torchrun (no launcher frame to catch it)
        return result

    validate_args.dcp_original = original
    return validate_args


def _cpu_defaults(args) -> None:
    """No GPU: the CPU flags (gloo, local spec, fusions off) unless the user gave them (Megatron parsed sys.argv)."""
    import sys

    import torch

    if torch.cuda.is_available():
        return
    from dcp_megatron.flags.cpu_defaults import apply_cpu_defaults, cpu_defaults_notice

    applied = apply_cpu_defaults(args, argv=sys.argv[1:])
    if applied and getattr(args, "rank", 0) == 0:
        print(cpu_defaults_notice(applied), flush=True)


# The GPU generation validate_args sees on CPU: Hopper (H200).
_CPU_DEVICE_ARCH = 9


def _cpu_device_arch_version() -> int:
    return _CPU_DEVICE_ARCH


CPU_PATCHES = (
    Patch(target=f"{_MODULE}:get_device_arch_version", replacement=_cpu_device_arch_version,
          reason="validate_args asks CUDA for the GPU generation when TP or CP > 1; on CPU: Hopper.",
          versions=MEGATRON_CORE_VERSIONS),
)


def dcp_patches(specs) -> tuple[Patch, ...]:
    """`specs`: the patch set's RunSpecSlot (training/arguments.py), shared with training_training.py's patches."""
    module = importlib.import_module(_MODULE)
    return (
        Patch(target=f"{_MODULE}:add_megatron_arguments",
              replacement=_with_dcp_arguments(unwrapped(module.add_megatron_arguments)),
              reason="adds the --dcp* argument group to Megatron's parser (no change to the user's script); "
                     "--distributed-timeout-minutes and --exit-duration-in-mins take fractions of a minute.",
              versions=MEGATRON_CORE_VERSIONS),
        Patch(target=f"{_MODULE}:validate_args",
              replacement=_with_dcp_validation(unwrapped(module.validate_args), specs),
              reason="no GPU: the CPU flags unless given; refuses flags --dcp cannot honour, unwritable output "
                     "paths and a --load with nothing to resume, at start-up; --dcp implies a per-token loss.",
              versions=MEGATRON_CORE_VERSIONS),
    )
