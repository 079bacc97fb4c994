"""Start-up refusals and notes of issue 36 as units: each check called on Megatron's parsed flags (no process
group, no launch). The one-line ending of a refusal through the user's entry point is tested in
tests/integration/test_start_checks.py and test_fault_matrix.py."""
from __future__ import annotations

import dataclasses

import pytest

from dcp_megatron.config import DcpConfig, DcpUsageError


@pytest.fixture(scope="module")
def parser():
    from dcp_megatron.deepspeed.arguments import megatron_parser

    return megatron_parser()   # Megatron's own parser with the --dcp group


def _args(parser, *flags, world_size=2, **attrs):
    args = parser.parse_args(["--deepspeed-config", "x.json", *flags])
    args.world_size, args.rank = world_size, 0
    vars(args).update(attrs)
    return args


# ------------------------------------------------------------------ world size vs TP x PP (item 10)

def test_a_world_size_that_tp_times_pp_does_not_divide_is_named(parser):
    from dcp_megatron.flags.flag_checks import check_model_parallel_tiles_world

    args = _args(parser, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", world_size=6)
    with pytest.raises(DcpUsageError) as err:
        check_model_parallel_tiles_world(args)
    assert str(err.value).startswith("world size 6 is not divisible by TP 2 x PP 2 = 4")
    assert "run a multiple of 4 ranks (e.g. 4)" in str(err.value) and "--pipeline-model-parallel-size" in str(err.value)
    with pytest.raises(DcpUsageError, match=r"by TP 1 x PP 1 x CP 2 = 2 .* --context-parallel-size"):
        check_model_parallel_tiles_world(_args(parser, "--context-parallel-size", "2", world_size=3))
    for fits in (_args(parser, "--tensor-model-parallel-size", "2", world_size=4), _args(parser, world_size=3)):
        check_model_parallel_tiles_world(fits)


# ------------------------------------------------------------- GPU-only flags on CPU (item 6)

@pytest.mark.parametrize("flags, message", [
    (["--fine-grained-activation-offloading", "--offload-modules", "core_attn"],
     "--fine-grained-activation-offloading --offload-modules needs a GPU"),
    (["--fine-grained-activation-offloading"], "--fine-grained-activation-offloading needs a GPU"),
    (["--offload-modules", "core_attn"], "on CPU drop --offload-modules"),
    (["--moe-grouped-gemm"], "--moe-grouped-gemm needs a GPU"),
])
def test_gpu_only_flags_are_refused_without_a_gpu(parser, flags, message):
    from dcp_megatron.flags.flag_checks import check_unrunnable_flags

    args = _args(parser, *flags)
    with pytest.raises(DcpUsageError) as err:
        check_unrunnable_flags(args, has_gpu=False)
    assert message in str(err.value)
    check_unrunnable_flags(args, has_gpu=True)   # megatron-core runs them on a GPU


# ------------------------------------------------------------- evaluation flags (items 2 and 8)

def test_eval_iters_zero_without_an_interval_trains_without_evaluating(parser, monkeypatch):
    """megatron.training 0.19.2 sizes the validation data by train_iters // eval_interval (None: TypeError)."""
    from megatron.training import training

    from dcp_megatron.flags.eval_flags import settle_eval_interval

    args = _args(parser, "--eval-iters", "0", "--train-iters", "10", "--global-batch-size", "8",
                 eval_global_batch_size=8)   # (Megatron's validate_args sets it)
    note = settle_eval_interval(args)
    assert args.eval_interval == 10 and "\n" not in note and "this run does not evaluate" in note
    monkeypatch.setattr(training, "get_args", lambda: args)
    assert training.get_train_valid_test_num_samples() == (80, 0, 0)
    args = _args(parser, "--eval-iters", "0", "--eval-interval", "4", "--train-iters", "10")
    assert settle_eval_interval(args) is None and args.eval_interval == 4   # given: kept


def test_eval_iters_without_an_interval_is_refused(parser):
    from dcp_megatron.flags.eval_flags import settle_eval_interval

    with pytest.raises(DcpUsageError, match="--eval-iters 3 needs --eval-interval N"):
        settle_eval_interval(_args(parser, "--eval-iters", "3", "--train-iters", "10"))
    with pytest.raises(DcpUsageError, match="--eval-iters 100 needs --eval-interval N .* --eval-iters 0"):
        settle_eval_interval(_args(parser, "--train-iters", "10"))   # Megatron's default --eval-iters
    assert settle_eval_interval(_args(parser, "--train-iters", "10", "--skip-train")) is None


@pytest.mark.parametrize("flags, noted", [
    (["--mock-data", "--split", "1,0,0", "--eval-iters", "2"], True),
    (["--mock-data", "--split", "100", "--eval-iters", "2"], True),
    (["--mock-data", "--split", "98,1,1", "--eval-iters", "2"], False),   # evaluation has its share
    (["--mock-data", "--split", "1,0,0", "--eval-iters", "0"], False),    # nothing is evaluated
    (["--data-path", "corpus", "--split", "1,0,0", "--eval-iters", "2"], False),   # real data follows --split
])
def test_mock_data_says_it_ignores_a_split_without_evaluation(parser, flags, noted):
    from dcp_megatron.flags.eval_flags import mock_split_note

    note = mock_split_note(_args(parser, *flags))
    assert (note is not None) == noted
    if noted:
        assert "--mock-data ignores --split" in note and "still evaluates" in note and "\n" not in note


def test_the_patched_validate_args_applies_the_evaluation_flags(parser, monkeypatch, capsys):
    """The seam every megatron.training run goes through (patches/training_arguments.py), with or without --dcp."""
    from patches.training_arguments import _with_dcp_validation

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py"])
    seen = {}

    def megatron_validate(args, defaults):
        seen["eval_interval"] = args.eval_interval
        raise DcpUsageError("stop here")   # the rest of the start-up is not this test's

    args = _args(parser, "--eval-iters", "0", "--train-iters", "10", "--mock-data", "--split", "1,0,0")
    with pytest.raises(SystemExit):
        _with_dcp_validation(megatron_validate)(args)
    assert seen["eval_interval"] == 10
    assert "dcp: --eval-iters 0: this run does not evaluate" in capsys.readouterr().out
    args = _args(parser, "--eval-iters", "2", "--eval-interval", "5", "--train-iters", "10", "--mock-data", "--split",
                 "1,0,0")
    with pytest.raises(SystemExit):
        _with_dcp_validation(megatron_validate)(args)
    assert capsys.readouterr().out.strip().splitlines()[1:] == [   # (after the CPU defaults' line)
        "dcp: note: --mock-data ignores --split 1,0,0 (megatron-core splits mock data 1,1,1), so this run still "
        "evaluates, on mock validation data; give --eval-iters 0 to train without evaluation"]


# ------------------------------------------------------------- recompute flags under --dcp (item 3)

_MOE_EP2 = ("--num-experts", "4", "--expert-model-parallel-size", "2")


@pytest.mark.parametrize("flags, messages", [
    (["--recompute-modules", "core_attn"], ["--recompute-modules core_attn conflicts with --dcp",
                                            "give --dcp-recompute none,core_attn instead"]),
    (["--recompute-modules", "core_attn", "mlp"], ["--dcp-recompute none,core_attn,mlp"]),
    (["--recompute-modules", "shared_experts"], ["--dcp-recompute has no shared_experts", "drop --recompute-modules"]),
    (["--recompute-method", "uniform", "--recompute-num-layers", "1"],
     ["--recompute-method uniform conflicts with --dcp", "full recompute of k layers", "--dcp-recompute none,full"]),
    (["--recompute-num-layers", "1"], ["--recompute-num-layers 1 conflicts with --dcp", "--dcp-recompute none,full"]),
    (["--moe-layer-recompute"], ["--moe-layer-recompute conflicts with --dcp", "give --dcp-recompute none,moe"]),
    (["--moe-layer-recompute", *_MOE_EP2],
     ["--moe-layer-recompute conflicts with --dcp", "--dcp-recompute moe is off under --expert-model-parallel-size 2",
      "MoE all-to-alls", "drop --moe-layer-recompute"]),
    (["--recompute-modules", "core_attn", "moe", *_MOE_EP2],
     ["give --dcp-recompute none,core_attn instead (--dcp-recompute moe is off under --expert-model-parallel-size 2"]),
    (["--recompute-granularity", "selective"], ["--recompute-granularity selective conflicts with --dcp"]),
])
def test_megatrons_recompute_flags_are_refused_under_dcp(parser, flags, messages):
    from dcp_megatron.training.arguments import refuse_conflicting_flags

    args = _args(parser, "--dcp", "--dataloader-inter-document-masking", "--attention-dropout", "0", *flags)
    with pytest.raises(DcpUsageError) as err:
        refuse_conflicting_flags(args)
    for message in messages:
        assert message in str(err.value), (message, str(err.value))
    refuse_conflicting_flags(_args(parser, *flags))   # without --dcp they are Megatron's


# ------------------------------------------------------------- the budget a refusal names (item 5)

def test_a_budget_refusal_names_the_budget_given_and_the_margin():
    from dcp_megatron.core.planning import check_longest_fits
    from dcp_megatron.planner.costmodel import CostModel, GiB, cpu_cluster, model_preset

    cluster = dataclasses.replace(cpu_cluster(2), mem_bytes_per_gpu=int(0.005 * GiB))
    cost = CostModel(model_preset("gpt-tiny"), cluster, allowed_recompute=("none",))
    with pytest.raises(DcpUsageError) as err:
        check_longest_fits(DcpConfig(seq_length=1 << 20, recompute=("none",), memory_budget_gb=0.005), cost)
    assert "within 0.0045 GiB per rank (--dcp-memory-budget-gb 0.005 less the 10% safety margin, 0.0005 GiB)" \
        in str(err.value), err.value
    with pytest.raises(DcpUsageError, match=r"\(the cpu preset's 0.005 GiB less the 10% safety margin"):
        check_longest_fits(DcpConfig(seq_length=1 << 20, recompute=("none",)), cost)


# ------------------------------------------------------------- DeepSpeed (item 7)

def test_deepspeed_fp16_is_refused_on_a_cpu_without_fp16_kernels():
    from dcp_megatron.deepspeed.config import check_precision_runs_here

    fp16 = {"fp16": {"enabled": True}}
    with pytest.raises(DcpUsageError, match=r'"fp16" is enabled .* no GPU .*"Type fp16 is not supported on your '
                                            r'device".* use "bf16"'):
        check_precision_runs_here(fp16, has_gpu=False, cpu_has_fp16=False)
    check_precision_runs_here(fp16, has_gpu=False, cpu_has_fp16=True)   # DeepSpeed's CPU accelerator runs it there
    check_precision_runs_here(fp16, has_gpu=True)
    check_precision_runs_here({"bf16": {"enabled": True}}, has_gpu=False, cpu_has_fp16=False)


def _tag(root, *names):
    root.mkdir(parents=True, exist_ok=True)
    for name in names:
        (root / name).write_bytes(b"x")
    return str(root)


def test_deepspeed_resume_under_another_zero_stage_names_both(tmp_path):
    from dcp_megatron.deepspeed.checkpoint import check_zero_stage, saved_zero_stage

    zero3 = _tag(tmp_path / "z3", "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt",
                 "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    zero2 = _tag(tmp_path / "z2", "mp_rank_00_model_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
    plain = _tag(tmp_path / "z0", "mp_rank_00_model_states.pt")
    assert [saved_zero_stage(d) for d in (zero3, zero2, plain)] == [3, 1, 0]
    stage = lambda n: {"zero_optimization": {"stage": n}}   # noqa: E731
    with pytest.raises(DcpUsageError) as err:
        check_zero_stage("ckpt", zero3, stage(2))
    assert "z3 was saved under ZeRO stage 3 and the DeepSpeed config asks for stage 2" in str(err.value)
    assert '"zero_optimization": {"stage": 3}' in str(err.value)
    with pytest.raises(DcpUsageError, match="saved under ZeRO stage 1 or 2 and the DeepSpeed config asks for stage 3"):
        check_zero_stage("ckpt", zero2, stage(3))
    with pytest.raises(DcpUsageError, match="saved under ZeRO stage 2 and .* asks for stage 0"):
        check_zero_stage("ckpt", zero2, stage(0), saved_stage=2)   # the manifest's record names it exactly
    with pytest.raises(DcpUsageError, match="saved under ZeRO stage 0 and .* asks for stage 1"):
        check_zero_stage("ckpt", plain, stage(1))
    check_zero_stage("ckpt", zero2, stage(1), saved_stage=2)   # stages 1 and 2 load each other's files
    check_zero_stage("ckpt", zero3, stage(3))
    check_zero_stage("ckpt", zero3, {**stage(2), "checkpoint": {"load_universal": True}})


# ------------------------------------------------------------- memory flags a layout cannot honour (issue 44)

@pytest.mark.parametrize("flags, named", [
    (["--dcp-memory-refine"], "--dcp-memory-refine cannot run"),
    (["--dcp-memory-probe"], "--dcp-memory-probe cannot run"),
    (["--dcp-memory-refine", "--dcp-memory-probe"], "--dcp-memory-refine and --dcp-memory-probe cannot run"),
])
def test_memory_flags_given_under_pipelining_are_refused_not_dropped(parser, flags, named):
    from dcp_megatron.training.checks.layout_checks import check_dcp_layout

    pp2 = ["--dcp", "--dataloader-inter-document-masking", "--pipeline-model-parallel-size", "2"]
    with pytest.raises(DcpUsageError) as err:
        check_dcp_layout(_args(parser, *pp2, *flags))
    assert named in str(err.value) and "--pipeline-model-parallel-size 2" in str(err.value)
    assert "run PP 1" in str(err.value) and "\n" not in str(err.value)
    check_dcp_layout(_args(parser, *pp2))                                       # off by default there
    check_dcp_layout(_args(parser, *pp2, "--dcp-no-memory-refine", "--dcp-no-memory-probe"))
    check_dcp_layout(_args(parser, "--dcp", *flags))                              # PP 1 runs them


def test_the_memory_probe_on_deepspeed_is_refused_not_dropped():
    from dcp_megatron.deepspeed.config import dcp_config

    cli = {"policy": None, "max_cp_size": None, "recompute": None}
    with pytest.raises(DcpUsageError, match="--dcp-memory-probe: the memory probe before step 1 runs under "
                                            "megatron.training only"):
        dcp_config({}, cli={**cli, "memory_probe": True}, seq_length=64, train_iters=2, log_interval=1,
                   dcp_flag=True)
    assert dcp_config({}, cli={**cli, "memory_probe": False}, seq_length=64, train_iters=2, log_interval=1,
                      dcp_flag=True).memory_probe is False
