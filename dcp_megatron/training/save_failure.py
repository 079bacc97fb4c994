"""A checkpoint save that fails (a full disk, a quota, an I/O error) ends the run in one line, leaving no partial
iteration directory behind.

megatron-core's torch_dist writer turns a writer's `OSError` into `RuntimeError: Worker failure: ...` and then a
`CheckpointException` on every rank (raised after the ranks agreed the save failed); the errno and the file were
only in an earlier log line, and the half-written `iter_*` directory stayed: a later `--ckpt-step`, or a run whose
tracker is gone, could take it for a checkpoint. Here (patches/training_checkpointing.py around `save_checkpoint`,
patches/core_dist_checkpointing_filesystem_async.py keeping the writer's errno and file) rank 0 removes the
directory the failed save was writing (never one the tracker names), says what failed (no space left on device,
which file) as the run's last line, and every rank exits with status 1.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import sys

from dcp_megatron.training.checkpoints import TRACKER_FILE

# How an OSError reads once the writer's threads passed it on as text: "[Errno 28] No space left on device: 'path'".
_OS_ERROR_TEXT = re.compile(r"\[Errno (\d+)\] ([^:'\n]+)(?:: '([^'\n]+)')?")


def os_error_in(err: BaseException) -> tuple[int, str, str | None] | None:
    """(errno, reason, file) of the OSError behind a failed save, from the exception chain, the per-rank failures
    of a CheckpointException, or their text; None when the failure was not the file system's."""
    stack, seen = [err], set()
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno:
            return current.errno, current.strerror or str(current), current.filename
        stack += [current.__cause__, current.__context__]
        for failure in (getattr(current, "failures", None) or {}).values():   # {rank: (exception, traceback)}
            stack.append(failure[0] if isinstance(failure, tuple) else failure)
    match = _OS_ERROR_TEXT.search(str(err))
    return (int(match[1]), match[2].strip(), match[3]) if match else None


def _tracked_iteration(save: str) -> str | None:
    try:
        with open(os.path.join(save, TRACKER_FILE)) as f:
            return f.read().strip()
    except OSError:
        return None


def _remove_partial(save: str, iteration: int) -> str | None:
    """Remove the directory the failed save of `iteration` was writing (unless the tracker names it)."""
    directory = os.path.join(save, f"iter_{iteration:07d}")   # Megatron's get_checkpoint_name(return_base_dir=True)
    tracked = _tracked_iteration(save)
    if not os.path.isdir(directory) or (tracked is not None and tracked.isdigit() and int(tracked) == iteration):
        return None
    shutil.rmtree(directory, ignore_errors=True)
    return directory


def failed_save_message(args: argparse.Namespace, iteration: int, err: BaseException, removed: str | None) -> str:
    cause = os_error_in(err)
    if cause is not None:
        code, reason, path = cause
        what = f"{reason} (errno {code})" + (f" writing {path}" if path else "")
    else:
        failures = getattr(err, "failures", None) or {}   # a CheckpointException: say the first rank's failure
        rank, failure = next(iter(sorted(failures.items(), key=lambda item: item[0])), (None, (err, None)))
        shown = failure[0] if isinstance(failure, tuple) else failure
        where = f"rank {rank}: " if rank is not None else ""
        what = f"{where}{type(shown).__name__}: {(str(shown).strip().splitlines() or [''])[0][:300]}"
    tracked = _tracked_iteration(args.save)
    kept = f"the latest checkpoint stays iteration {tracked}" if tracked else "no earlier checkpoint exists"
    gone = f"removed the partial {removed}; " if removed else ""
    return (f"iteration {iteration}: saving the checkpoint to --save {args.save} failed: {what}; {gone}{kept}. "
            f"Free space (or give another --save), then resume with --load {args.save}")


@contextlib.contextmanager
def failed_save_ends_run(args: argparse.Namespace, iteration: int):
    """Around Megatron's save_checkpoint: a failed save ends the process (SystemExit 1) as the module docstring
    says. A CheckpointException reaches every rank (Megatron broadcast the failure), so they meet in one barrier
    after rank 0 cleaned up; any other failure is this rank's own, and it reports it itself."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except (Exception, CheckpointException) as err:   # CheckpointException is a BaseException
        import torch

        if not getattr(args, "save", None):
            raise
        initialized = torch.distributed.is_initialized()
        rank = torch.distributed.get_rank() if initialized else 0
        everywhere = isinstance(err, CheckpointException)
        if rank == 0:
            removed = _remove_partial(args.save, iteration)
            print(f"dcp: error: {failed_save_message(args, iteration, err, removed)}", file=sys.stderr, flush=True)
        elif not everywhere:
            print(f"dcp: error: rank {rank}, {failed_save_message(args, iteration, err, None)}", file=sys.stderr,
                  flush=True)
        if everywhere and initialized:
            torch.distributed.barrier()   # rank 0 has cleaned up and said why before any rank exits
        raise SystemExit(1) from None
