"""Start-up refusals of issue 46 as units (no process group, no launch): Megatron's recompute flags under --dcp on
both engines, DeepSpeed's "activation_checkpointing" block, a --split without a validation share when evaluating,
and token ids outside the vocabulary. The one-line ending through the entry points is test_fault_matrix.py's."""
from __future__ import annotations

import json

import numpy as np
import pytest

from dcp_megatron.config import DcpUsageError

pytest.importorskip("megatron.training")


@pytest.fixture(scope="module")
def parser():
    from dcp_megatron.deepspeed.arguments import megatron_parser

    return megatron_parser()


def _args(parser, *flags, **attrs):
    args = parser.parse_args(["--deepspeed-config", "x.json", *flags])
    args.world_size, args.rank = 2, 0
    vars(args).update(attrs)
    return args


# ------------------------------------------------------------------ recompute flags under --dcp

def test_recompute_activations_is_refused_under_dcp_before_megatron_turns_it_into_selective(parser):
    from dcp_megatron.training.arguments import refuse_conflicting_flags

    args = _args(parser, "--dcp", "--dataloader-inter-document-masking", "--attention-dropout", "0",
                 "--recompute-activations")
    with pytest.raises(DcpUsageError) as err:
        refuse_conflicting_flags(args)
    line = str(err.value)
    assert line.startswith("--recompute-activations conflicts with --dcp") and "\n" not in line
    assert "give --dcp-recompute none,selective instead" in line
    refuse_conflicting_flags(_args(parser, "--recompute-activations"))   # without --dcp: Megatron's


def _deepspeed_args(tmp_path, monkeypatch, flags, **config_extra):
    from dcp_megatron.deepspeed.arguments import parse_args
    from tests.support.deepspeed_runs import TINY_MODEL, ds_config

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds_config(stage=1, total_steps=9, **config_extra)))
    return parse_args([*TINY_MODEL, "--deepspeed-config", str(path), "--train-iters", "9", *flags])


@pytest.mark.parametrize("flags, message", [
    (["--recompute-activations"], "--recompute-activations conflicts with --dcp"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
     "--recompute-granularity full conflicts with --dcp"),
])
@pytest.mark.parametrize("dcp_on", ["flag", "json"])
def test_the_deepspeed_script_refuses_megatrons_recompute_flags_under_dcp(tmp_path, monkeypatch, flags, message,
                                                                          dcp_on):
    """Checked on the flags as Megatron's validate_args left them (--recompute-activations is gone by then)."""
    from dcp_megatron.deepspeed.setup import deepspeed_setup

    extra = {"dcp": {"enabled": True}} if dcp_on == "json" else {}
    args = _deepspeed_args(tmp_path, monkeypatch, flags + (["--dcp"] if dcp_on == "flag" else []), **extra)
    with pytest.raises(DcpUsageError) as err:
        deepspeed_setup(args, has_gpu=False)
    kind = "selective" if "--recompute-activations" in flags else "full"
    assert str(err.value).startswith(message) and f"--dcp-recompute none,{kind}" in str(err.value)
    _, config = deepspeed_setup(_deepspeed_args(tmp_path, monkeypatch, flags), has_gpu=False)   # without DCP:
    assert config.policy == "static"   # megatron-core's model runs them


def test_deepspeeds_activation_checkpointing_block_is_refused(tmp_path, monkeypatch):
    """megatron-core's GPTModel never calls deepspeed.checkpointing, which the block configures."""
    from dcp_megatron.deepspeed.setup import deepspeed_setup

    args = _deepspeed_args(tmp_path, monkeypatch, ["--dcp"],
                           activation_checkpointing={"partition_activations": False, "number_checkpoints": 1})
    with pytest.raises(DcpUsageError, match=r'^the DeepSpeed config\'s "activation_checkpointing" block .*'
                                            r"--dcp-recompute"):
        deepspeed_setup(args, has_gpu=False)


# ------------------------------------------------------------------ --split without validation, evaluating

@pytest.mark.parametrize("flags, refused", [
    (["--split", "100,0,0", "--eval-iters", "2", "--eval-interval", "3"], True),
    (["--split", "100,0,0", "--full-validation"], True),
    (["--split", "100,0,0", "--eval-iters", "0"], False),
    (["--split", "98,2,0", "--eval-iters", "2", "--eval-interval", "3"], False),
    (["--eval-iters", "2", "--eval-interval", "3"], False),   # Megatron's default split has a validation share
    (["--split", "100,0,0", "--eval-iters", "2", "--eval-interval", "3", "--valid-data-path", "v"], False),
])
def test_a_split_without_validation_is_refused_when_evaluation_is_asked(parser, flags, refused):
    from dcp_megatron.flags.eval_flags import settle_evaluation_flags

    args = _args(parser, "--data-path", "corpus", "--train-iters", "6", *flags)
    if not refused:
        settle_evaluation_flags(args)
        return
    with pytest.raises(DcpUsageError) as err:
        settle_evaluation_flags(args)
    line = str(err.value)
    assert line.startswith("--split 100,0,0 gives the validation set no share, but evaluation is asked")
    assert "e.g. --split 98,2,0" in line and "--eval-iters 0" in line and "\n" not in line


def test_the_deepspeed_script_refuses_a_split_without_validation(tmp_path, monkeypatch):
    from tests.support.deepspeed_runs import write_blend

    blend = [flag if flag != "90,5,5" else "100,0,0" for flag in write_blend(str(tmp_path))]
    with pytest.raises(DcpUsageError, match=r"^--split 100,0,0 gives the validation set no share"):
        _deepspeed_args_without_mock(tmp_path, monkeypatch, [*blend, "--eval-iters", "2", "--eval-interval", "3"])


def _deepspeed_args_without_mock(tmp_path, monkeypatch, flags):
    from dcp_megatron.deepspeed.arguments import parse_args
    from tests.support.deepspeed_runs import TINY_MODEL, ds_config

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds_config(stage=1, total_steps=9)))
    model = [flag for flag in TINY_MODEL if flag != "--mock-data"]
    split_at = model.index("--split")
    del model[split_at:split_at + 2]
    return parse_args([*model, "--deepspeed-config", str(path), "--train-iters", "9", *flags])


# ------------------------------------------------------------------ token ids outside the vocabulary

def _byte_corpus(tmp_path) -> str:
    """A corpus as tools/preprocess_data.py writes it (byte tokenizer: ids 0-255, end of document 256)."""
    from dcp_megatron.data.preprocess import make_tokenizer, preprocess_texts

    prefix = str(tmp_path / "bytes")
    preprocess_texts(["hello world " * 20, "ünïcödé text", "short"], prefix, make_tokenizer())
    return prefix


def test_token_ids_at_or_above_the_vocab_size_are_named_at_start(parser, tmp_path):
    from dcp_megatron.flags.data_files import check_data_files, largest_token_id

    prefix = _byte_corpus(tmp_path)
    assert largest_token_id(prefix) == 256   # (the end-of-document id)
    args = _args(parser, "--data-path", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size", "128")
    with pytest.raises(DcpUsageError) as err:
        check_data_files(args)
    line = str(err.value)
    assert line.startswith(f"--data-path: {prefix}.bin holds token id 256, outside the vocabulary of --vocab-size "
                           "128 (NullTokenizer: ids 0-127)")
    assert "give --vocab-size 257 or more" in line and "\n" not in line
    check_data_files(_args(parser, "--data-path", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size", "257"))


def test_the_token_scan_reads_in_chunks_up_to_its_bound(tmp_path, monkeypatch):
    """A large id past the scanned bytes is not read (the bound); chunking finds an id in any chunk."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    import torch

    from dcp_megatron.flags import data_files

    prefix = str(tmp_path / "c")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    tokens = np.zeros(1000, dtype=np.uint16)
    tokens[700] = 900
    builder.add_document(torch.from_numpy(tokens), [1000])
    builder.finalize(prefix + ".idx")
    monkeypatch.setattr(data_files, "_CHUNK_ITEMS", 64)
    assert data_files.largest_token_id(prefix) == 900
    monkeypatch.setattr(data_files, "SCAN_BYTES", 2 * 700)
    assert data_files.largest_token_id(prefix) == 0


def test_the_deepspeed_script_refuses_the_megatron_path_diagnostics_flag(tmp_path, monkeypatch):
    from dcp_megatron.deepspeed.setup import deepspeed_setup

    args = _deepspeed_args(tmp_path, monkeypatch, ["--dcp", "--dcp-dump-saved-bytes", str(tmp_path)])
    with pytest.raises(DcpUsageError, match=r"^--dcp-dump-saved-bytes .*megatron.training path"):
        deepspeed_setup(args, has_gpu=False)


@pytest.mark.parametrize("before_megatron", [True, False])
def test_the_megatron_start_refuses_recompute_activations_as_validate_args_leaves_it(parser, monkeypatch, capsys,
                                                                                   before_megatron):
    """Through the patched validate_args with Megatron's own checks between ours: refused before them (naming the
    flag given), and, with that first check taken out, after them (as granularity selective)."""
    from megatron.training import arguments as megatron_arguments

    from dcp_megatron.config import RunSpecSlot
    from dcp_megatron.flags.dcp_flags import unwrapped
    from dcp_megatron.training import arguments
    from patches.training_arguments import _with_dcp_validation
    from tests.support.deepspeed_runs import TINY_MODEL

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py"])
    if not before_megatron:
        monkeypatch.setattr(arguments, "refuse_conflicting_flags", lambda args: None)
    args = parser.parse_args(["--deepspeed-config", "x.json", *TINY_MODEL, "--train-iters", "4", "--eval-iters", "0",
                              "--dcp", "--recompute-activations"])
    args.world_size, args.rank = 1, 0
    validate = _with_dcp_validation(unwrapped(megatron_arguments.validate_args), RunSpecSlot())
    with pytest.raises(SystemExit) as exit_:
        validate(args, {"tokenizer_type": "NullTokenizer"})
    line = capsys.readouterr().err.strip().splitlines()[-1]
    given = "--recompute-activations" if before_megatron else "--recompute-granularity selective"
    assert exit_.value.code == 2 and line.startswith(f"dcp: error: {given} conflicts with --dcp"), line
    assert "--dcp-recompute none,selective" in line


def test_a_plain_megatron_run_refuses_a_split_without_validation_at_start(parser, monkeypatch, capsys):
    """Without --dcp too: the seam every megatron.training run goes through (also under dcp_megatron.launch)."""
    from patches.training_arguments import _with_dcp_validation

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py"])

    def megatron_validate(args, defaults):
        raise AssertionError("refused before Megatron's own checks")

    args = _args(parser, "--data-path", "corpus", "--split", "100,0,0", "--eval-iters", "2", "--eval-interval", "3",
                 "--train-iters", "6")
    with pytest.raises(SystemExit) as exit_:
        _with_dcp_validation(megatron_validate)(args)
    line = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and line.startswith("dcp: error: --split 100,0,0 gives the validation set no share")


def test_the_saved_bytes_directory_is_checked_at_start(parser, tmp_path):
    from dcp_megatron.training.checks.run_paths import check_run_paths

    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    with pytest.raises(DcpUsageError, match=r"^--dcp-dump-saved-bytes .*a_file: exists and is not a directory"):
        check_run_paths(_args(parser, "--dcp", "--dcp-dump-saved-bytes", str(a_file)))
    check_run_paths(_args(parser, "--dcp", "--dcp-dump-saved-bytes", str(tmp_path / "new")))
