"""`dcp-profile` (also `tools/profile.py`): measure the cost model of the user's model from its training flags.

    dcp-profile [--nproc N] [--script SCRIPT] [--layers K] [--repeats R] [--clock cpu|wall]
                --out PROFILE.json [--report REPORT.json] -- <the training run's Megatron flags>

It runs the training script (default: pretrain_scripts/pretrain_gpt.py; any megatron.training script
whose model is a megatron-core GPTModel) under torchrun with N ranks through `dcp_megatron.launch`,
with the same flags as training plus `--dcp --dcp-profile-out`: Megatron builds the model, optimizer
and data exactly as for training (with K layers when --layers is given: a few layers are enough, and
the profile is scaled to the run's --num-layers), then, instead of training, times a grid of
micro-batches (document lengths x packing x recompute x CP sizes up to N / TP) through the model and
Megatron's schedule, fits the cost model's constants (planner/costmodel/profile_fit.py) and writes the profile
JSON that `--dcp-profile` reads. The held-back grid points' predicted vs measured time and memory
are printed and, with --report, written as JSON (median_rel_error, max_rel_error per micro-batch
time, and per point). Run it on the machine type the training runs on, with its TP size.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_SCRIPT = os.path.join(REPO, "pretrain_scripts", "pretrain_gpt.py")


def _flag_value(flags: list[str], name: str) -> str | None:
    for i, flag in enumerate(flags):
        if flag == name and i + 1 < len(flags):
            return flags[i + 1]
        if flag.startswith(name + "="):
            return flag.split("=", 1)[1]
    return None


def _with_layers(flags: list[str], layers: int) -> list[str]:
    out, skip = [], False
    for flag in flags:
        if skip:
            skip = False
        elif flag == "--num-layers":
            skip = True
        elif not flag.startswith("--num-layers="):
            out.append(flag)
    return out + ["--num-layers", str(layers)]


def profile_command(args: argparse.Namespace, flags: list[str]) -> list[str]:
    """The torchrun command line of the profiling run (raises ValueError for flags it cannot use)."""
    trained = _flag_value(flags, "--num-layers")
    if trained is None or not trained.isdigit():
        raise ValueError("give the training run's flags after --, including --num-layers")
    extra = ["--dcp-profile-out", os.path.abspath(args.out)]
    if args.report:
        extra += ["--dcp-profile-report", os.path.abspath(args.report)]
    if args.repeats is not None:
        extra += ["--dcp-profile-repeats", str(args.repeats)]
    if args.clock is not None:
        extra += ["--dcp-profile-clock", args.clock]
    if args.layers is not None:
        if not 1 <= args.layers <= int(trained):
            raise ValueError(f"--layers must be between 1 and the run's --num-layers {trained}, got {args.layers}")
        flags = _with_layers(flags, args.layers)
        extra += ["--dcp-profile-scale-to-layers", trained]
    if "--dcp" not in flags:
        flags = flags + ["--dcp"]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}", "--nnodes=1",
            "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "dcp_megatron.launch",
            os.path.abspath(args.script), *flags, *extra]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="dcp-profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="profile JSON to write (what --dcp-profile reads)")
    parser.add_argument("--report", default=None, help="held-back predicted-vs-measured JSON to write")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (CP sizes up to nproc / TP are profiled)")
    parser.add_argument("--script", default=DEFAULT_SCRIPT, help="the training script (megatron.training)")
    parser.add_argument("--layers", type=int, default=None, help="build the model with this many layers")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per grid point (default 3)")
    parser.add_argument("--clock", choices=("cpu", "wall"), default=None,
                        help="CPU runs: process CPU time (default; steady on a shared machine) or wall time")
    args = parser.parse_args(ours)
    if args.nproc < 1:
        parser.error(f"--nproc must be >= 1, got {args.nproc}")
    if not os.path.isfile(args.script):
        parser.error(f"--script {args.script}: no such file")
    try:
        command = profile_command(args, flags)
    except ValueError as err:
        parser.error(str(err))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(command, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
