"""Run a user's Megatron-LM script with DCP available: `python -m dcp_megatron.launch SCRIPT [ARGS]`.

    torchrun --nproc-per-node N -m dcp_megatron.launch path/to/pretrain_gpt.py <Megatron flags> --dcp [--dcp-*]

The launcher changes nothing in the script. It applies our patch set to megatron-core and
megatron.training (version-checked; the CPU shims only when there is no GPU), which also adds
the `--dcp*` flags to Megatron's own argument parser, and runs the script as `__main__` from its
own directory (so its sibling imports, e.g. Megatron-LM's `gpt_builders`, resolve). Without
`--dcp` Megatron's loop runs exactly as it would without us, apart from the CPU shims.
"""
from __future__ import annotations

import os
import runpy
import sys

from dcp_megatron.config import DcpUsageError
from dcp_megatron.flags.refusal import exit_refused
from patches.registry import PatchVersionError


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        sys.exit(0 if argv else 2)
    script, script_args = argv[0], argv[1:]
    if not os.path.isfile(script):
        print(f"dcp_megatron.launch: error: script {script!r} does not exist", file=sys.stderr)
        sys.exit(2)
    import dcp_megatron

    try:
        registry = dcp_megatron.enable()
    except PatchVersionError as err:
        print(f"dcp_megatron.launch: error: {err}", file=sys.stderr)
        sys.exit(2)
    script = os.path.abspath(script)
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except DcpUsageError as err:
        # A flag or input --dcp cannot honour: the same one line as a plain-torchrun run prints.
        exit_refused(err)
    finally:
        registry.remove()


if __name__ == "__main__":
    main()
