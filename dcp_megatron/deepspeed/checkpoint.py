"""DeepSpeed checkpoints of a run: DeepSpeed's own files, with the iteration and data position inside.

`engine.save_checkpoint(dir, tag, client_state)` writes the model, optimizer and scheduler states
and the `latest` tag file; our client state adds the iteration and the data stream's position (the
first global batch not trained yet), so a resumed run trains exactly the batches an uninterrupted
one would. Paths are checked at start (before any process group): a `--save` that is a file or not
writable would otherwise fail at the first save, after training; a `--load` without a checkpoint
would make DeepSpeed warn and train from scratch.
"""
from __future__ import annotations

import glob
import os

from dcp_megatron.megatron.dcp_args import DcpUsageError
from dcp_megatron.megatron.run_paths import check_resume_dir, check_writable_dir

LATEST_FILE = "latest"   # DeepSpeed's tag file
_CLIENT_KEY = "dcp_megatron"


def holds_deepspeed_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, LATEST_FILE)) or bool(glob.glob(os.path.join(path, "*", "*model_states.pt")))


def check_checkpoint_paths(*, save: str | None, load: str | None, dump_plans: str | None) -> None:
    for flag, path in (("--save", save), ("--dcp-dump-plans", dump_plans)):
        if path:
            check_writable_dir(path, flag)
    if load:
        check_resume_dir(load, holds=holds_deepspeed_checkpoint,
                         expected=f"DeepSpeed checkpoint (no '{LATEST_FILE}' file and no <tag>/*model_states.pt)")


def tag_of(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def save(engine, directory: str, *, iteration: int, data_state: dict) -> None:
    """A collective: every rank calls it (ZeRO ranks write their own optimizer shards)."""
    engine.save_checkpoint(directory, tag=tag_of(iteration),
                           client_state={_CLIENT_KEY: {"iteration": iteration, "data": data_state}})


def load(engine, directory: str) -> tuple[int, dict]:
    """(iteration trained, data position) of the latest checkpoint in `directory` (a collective)."""
    path, client_state = engine.load_checkpoint(directory)
    if path is None:
        raise DcpUsageError(f"--load {directory}: DeepSpeed found no loadable checkpoint there")
    ours = (client_state or {}).get(_CLIENT_KEY)
    if not isinstance(ours, dict) or not {"iteration", "data"} <= set(ours):
        raise DcpUsageError(f"--load {directory}: checkpoint {path} was not written by this script (no data position "
                            "in its client state), so the run cannot continue its data where it stopped")
    return int(ours["iteration"]), ours["data"]
