"""Without a GPU, the CPU flags are defaulted unless given, and the run says so in one line (no process launched:
the real runs without CPU flags are in tests/integration/test_deepspeed.py and tests/integration/test_megatron_loop.py)."""

import pytest

from dcp_megatron.flags.cpu_defaults import CPU_DEFAULTS, apply_cpu_defaults, cpu_defaults_notice


@pytest.fixture(scope="module")
def parser():
    from dcp_megatron.deepspeed.arguments import megatron_parser

    return megatron_parser()


def _args(parser, *flags):
    return parser.parse_args(["--deepspeed-config", "x.json", *flags])


def test_every_default_is_a_megatron_flag_that_differs_from_megatrons_default(parser):
    args = _args(parser)
    options = {s for action in parser._actions for s in action.option_strings}
    for default in CPU_DEFAULTS:
        assert default.flag in options and getattr(args, default.dest) != default.value, default


def test_missing_flags_are_set_and_named(parser):
    args = _args(parser)
    applied = apply_cpu_defaults(args, argv=[])
    assert applied == [d.shown for d in CPU_DEFAULTS]
    assert args.distributed_backend == "gloo" and args.transformer_impl == "local"
    assert args.use_cpu_initialization and not args.gradient_accumulation_fusion and not args.apply_rope_fusion
    line = cpu_defaults_notice(applied)
    assert "\n" not in line and "--distributed-backend gloo" in line and "--no-rope-fusion" in line


def test_explicit_flags_win(parser):
    argv = ["--distributed-backend=nccl", "--transformer-impl", "transformer_engine", "--no-rope-fusion"]
    args = _args(parser, *argv)
    applied = apply_cpu_defaults(args, argv=argv)
    assert args.distributed_backend == "nccl" and args.transformer_impl == "transformer_engine"
    assert not any(s.startswith(("--distributed-backend", "--transformer-impl", "--no-rope-fusion")) for s in applied)
    assert "--use-cpu-initialization" in applied
    assert apply_cpu_defaults(args, argv=argv) == []   # already set: nothing more to say
