"""Megatron's evaluation flags where megatron.training 0.19.2 fails on them or ignores them without a word.

- `--eval-interval` defaults to None in 0.19.2, and sizing the validation dataset divides `--train-iters` by it
  (training.get_train_valid_test_num_samples): a `TypeError` ~45 s in, after the model is built. With
  `--eval-iters 0` nothing is evaluated anyway, so the interval is set to `--train-iters` (the sizes come out 0)
  and the run says in one line that it does not evaluate. With `--eval-iters N > 0` (100 by default) there is no
  interval to guess: refused, naming both flags.
- `--mock-data` ignores `--split`: megatron-core's dataset config sets the split to 1,1,1 for mock data and logs
  it at INFO only, so a `--split 1,0,0` meant to turn evaluation off still evaluates on mock validation data.
  The run says so in one line.
- `--split` with no validation share (`100,0,0`) over `--data-path` while evaluation is asked (`--eval-iters N > 0`
  with `--eval-interval`, or `--full-validation`): megatron-core builds no validation dataset and the first
  evaluation dies with `TypeError: 'NoneType' object is not an iterator` after the interval's steps trained.
  Refused, naming both flags.

Both paths call these: the Megatron path from the patched `validate_args` (patches/training_arguments.py), the
DeepSpeed script when it evaluates (its evaluation sizes the validation data the same way, evaluation.py).
"""
from __future__ import annotations

import argparse
import re

from dcp_megatron.config import DcpUsageError

_DATA_PATHS = ("data_path", "train_data_path", "valid_data_path", "test_data_path", "data_args_path",
               "per_split_data_args_path")


def settle_eval_interval(args: argparse.Namespace) -> str | None:
    """Set `--eval-interval` where `--eval-iters 0` leaves it unset (the note to print), or refuse a missing one."""
    # Full validation and --skip-train size their data without the interval; sample-counted runs stop on
    # Megatron's own assertion that --train-iters is set.
    if getattr(args, "eval_interval", None) is not None or getattr(args, "skip_train", False) \
            or getattr(args, "full_validation", False) or not getattr(args, "train_iters", None):
        return None
    eval_iters = getattr(args, "eval_iters", None)
    if not isinstance(eval_iters, int):
        return None
    if eval_iters == 0:
        args.eval_interval = args.train_iters
        return (f"dcp: --eval-iters 0: this run does not evaluate (--eval-interval set to --train-iters "
                f"{args.train_iters}: megatron.training 0.19.2 divides by it when it sizes the validation data)")
    raise DcpUsageError(f"--eval-iters {eval_iters} needs --eval-interval N (iterations between evaluations; "
                        "megatron.training 0.19.2 has no default and fails on the missing one after start-up): give "
                        "--eval-interval, or --eval-iters 0 to train without evaluation")


def settle_evaluation_flags(args: argparse.Namespace) -> None:
    """Both of the module docstring's checks, their lines printed once (rank 0); both entry points call this."""
    check_validation_split(args)
    notes = [note for note in (settle_eval_interval(args), mock_split_note(args)) if note]
    if notes and getattr(args, "rank", 0) == 0:
        print("\n".join(notes), flush=True)


def _split_shares(split: str) -> list[float]:
    return [float(part) for part in re.findall(r"[.0-9]+", split)] + [0.0, 0.0, 0.0]   # as megatron-core parses it


def check_validation_split(args: argparse.Namespace) -> None:
    """Refuse a --split without a validation share over --data-path when evaluation is asked (module docstring)."""
    split = getattr(args, "split", None)
    blended = getattr(args, "data_path", None) or getattr(args, "data_args_path", None)
    per_split = any(getattr(args, name, None) for name in ("valid_data_path", "per_split_data_args_path"))
    if not split or not blended or per_split or getattr(args, "mock_data", False):
        return
    eval_iters = getattr(args, "eval_iters", 0) or 0
    full = getattr(args, "full_validation", False)
    if not (full or (eval_iters > 0 and getattr(args, "eval_interval", None) is not None)):
        return   # (an --eval-iters without an interval is refused by settle_eval_interval)
    shares = _split_shares(split)
    if shares[1] > 0:
        return
    asked = "--full-validation" if full else f"--eval-iters {eval_iters} --eval-interval {args.eval_interval}"
    train, test = shares[0], shares[2]
    example = f"{max(train - 2, 1):g},2,{test:g}" if train > 2 else "98,2,0"
    raise DcpUsageError(f"--split {split} gives the validation set no share, but evaluation is asked ({asked}): "
                        f"give a --split with a validation share (e.g. --split {example}), or --eval-iters 0 to "
                        "train without evaluation")


def mock_split_note(args: argparse.Namespace) -> str | None:
    """The line for a --split that gives evaluation no share when mock data ignores it (module docstring)."""
    split = getattr(args, "split", None)
    if not (getattr(args, "mock_data", False) and split) or any(getattr(args, name, None) for name in _DATA_PATHS):
        return None
    if not (getattr(args, "full_validation", False) or (getattr(args, "eval_iters", 0) or 0) > 0):
        return None
    if _split_shares(split)[1] > 0:
        return None
    return (f"dcp: note: --mock-data ignores --split {split} (megatron-core splits mock data 1,1,1), so this run "
            f"still evaluates, on mock validation data; give --eval-iters 0 to train without evaluation")
