"""Every Megatron flag the DeepSpeed script parses is honoured or refused by name (deepspeed/flag_coverage.py)."""
from __future__ import annotations

import argparse
import hashlib

import pytest

from dcp_megatron.config import DcpUsageError

pytest.importorskip("megatron.training")

# sha256 of megatron.training 0.19.2's sorted flag destinations (its own parser, without ours): a release
# that adds or renames flags fails here until each new one is honoured (flag_coverage.HONOURED) or left refused.
MEGATRON_FLAGS_SHA256 = "7f41e72742a98ce49831caad35168cc26b5e101542eb6258f78bad635a6c6648"
_CANDIDATES = ("3", "0.5", "x", "1,2", "a:b", "7 8")


@pytest.fixture(scope="module")
def parser():
    from dcp_megatron.deepspeed.arguments import megatron_parser

    return megatron_parser()


def _given(parser, action: argparse.Action, baseline):
    """(argv, args) giving `action` a value other than `baseline` (the parser's own without it); None if no
    candidate parses."""
    option = action.option_strings[0]
    if action.nargs == 0:
        candidates = [[option]]
    elif action.choices:
        candidates = [[option, getattr(choice, "name", str(choice))] for choice in action.choices]
    else:
        candidates = [[option, *value.split()] for value in _CANDIDATES]
    for flags in candidates:
        argv = ["--deepspeed-config", "x.json", *flags]
        try:
            args = parser.parse_args(argv)
        except (SystemExit, Exception):   # (a type's own error: KeyError for an enum's unknown name, ...)
            continue
        if getattr(args, action.dest) != baseline:
            return argv, args
    return None


def test_every_megatron_flag_is_honoured_or_refused_by_name(parser, capsys):
    from dcp_megatron.deepspeed.flag_coverage import honoured_destinations, refuse_unhonoured_flags

    honoured = honoured_destinations()
    refused, unparsed = 0, []
    baseline = parser.parse_args(["--deepspeed-config", "x.json"])
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        given = _given(parser, action, getattr(baseline, action.dest))
        if given is None:
            unparsed.append(action.dest)
            continue
        argv, args = given
        if action.dest in honoured:
            refuse_unhonoured_flags(parser, args, argv)
            continue
        with pytest.raises(DcpUsageError) as err:
            refuse_unhonoured_flags(parser, args, argv)
        assert str(err.value).startswith(argv[2]) and "\n" not in str(err.value), (action.dest, str(err.value))
        refused += 1
    capsys.readouterr()   # (argparse's usage lines of the candidates that did not parse)
    assert refused > 400 and len(unparsed) < 10, unparsed


def test_the_flag_set_is_the_one_classified():
    import argparse

    from megatron.training import arguments

    from dcp_megatron.flags.dcp_flags import unwrapped

    megatron = unwrapped(arguments.add_megatron_arguments)(argparse.ArgumentParser(allow_abbrev=False))
    dests = sorted({action.dest for action in megatron._actions})
    digest = hashlib.sha256("\n".join(dests).encode()).hexdigest()
    assert digest == MEGATRON_FLAGS_SHA256, (
        f"Megatron's parser changed ({len(dests)} flag destinations): classify the new flags in "
        "dcp_megatron/deepspeed/flag_coverage.py (HONOURED where the DeepSpeed script runs them), then set "
        f"MEGATRON_FLAGS_SHA256 = {digest!r}")


@pytest.mark.parametrize("flags, message", [
    (["--ckpt-step", "3"], "--ckpt-step 3: the DeepSpeed script resumes from the checkpoint the 'latest' file"),
    (["--exit-duration-in-mins", "5"], "--exit-duration-in-mins is a megatron.training flag the DeepSpeed script "
                                       "does not run"),
    (["--use-rope-scaling"], "--use-rope-scaling is a megatron.training flag the DeepSpeed script does not run"),
    (["--no-save-optim"], "(DeepSpeed writes and loads the checkpoints"),
])
def test_flags_the_deepspeed_script_does_not_run_are_named(tmp_path, monkeypatch, flags, message):
    """Through the script's own parse_args (the specific refusals of arguments.py run first)."""
    import json

    from dcp_megatron.deepspeed.arguments import parse_args
    from tests.support.deepspeed_runs import TINY_MODEL, ds_config

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds_config(stage=1, total_steps=9)))
    base = [*TINY_MODEL, "--deepspeed-config", str(path), "--train-iters", "9"]
    with pytest.raises(DcpUsageError) as err:
        parse_args([*base, *flags])
    assert message in str(err.value)
    honoured = ["--exit-interval", "2", "--eval-iters", "2", "--eval-interval", "3", "--save", str(tmp_path / "ckpt"),
                "--save-interval", "2", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--min-lr", "1e-5",
                "--lr", "3e-3", "--clip-grad", "1.0", "--weight-decay", "0.1", "--init-method-std", "0.02",
                "--no-bias-swiglu-fusion", "--recompute-activations", "--eod-mask-loss"]
    args = parse_args([*base, *honoured])   # what the script runs (trainer.py, lr_schedule.py, the JSON, the model)
    assert args.exit_interval == 2 and args.eval_interval == 3
