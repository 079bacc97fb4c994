"""The GPU path checked on CPU (issue 19): FP8 refusals at start, the FP8 row alignment, the recompute path
under FP8, apex's fusion switch, the per-device CP stream, DeepSpeed's optimizer and shm-comm settings."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from dcp_megatron.config import DcpUsageError  # noqa: E402
from dcp_megatron.flags.dcp_flags import add_dcp_arguments
from dcp_megatron.training.arguments import validate_dcp_args
from dcp_megatron.flags.fp8_checks import DeviceFacts, fp8_row_multiple  # noqa: E402
from dcp_megatron.training.checks.gpu_checks import check_gpu_path  # noqa: E402
from dcp_megatron.core.microbatches import aligned_filler_rows, build_batch  # noqa: E402
from dcp_megatron.planner.plan import NO_RECOMPUTE, Recompute  # noqa: E402
from tests.support.dist_utils import run_distributed  # noqa: E402

H200 = DeviceFacts(has_gpu=True, has_transformer_engine=True, capability=(9, 0), cuda_version=(13, 0),
                   has_apex_wgrad_fusion=True)
CPU = DeviceFacts(has_gpu=False, has_transformer_engine=False, cuda_version=(13, 0))


def _args(**overrides) -> argparse.Namespace:
    args = add_dcp_arguments(argparse.ArgumentParser()).parse_args([])
    vars(args).update(dict(
        dcp=True, fp8=None, fp8_recipe="delayed", context_parallel_size=1, hybrid_context_parallel=False,
        recompute_granularity=None, pipeline_model_parallel_size=1, tensor_model_parallel_size=1,
        sequence_parallel=False, attention_dropout=0.0, virtual_pipeline_model_parallel_size=None,
        micro_batch_size=1, dataloader_inter_document_masking=True, data_parallel_size=2,
        calculate_per_token_loss=True, rank=0, seq_length=1024, log_interval=1, gradient_accumulation_fusion=False))
    vars(args).update(overrides)
    return args


@pytest.mark.parametrize("device, overrides, message", [
    (CPU, dict(fp8="hybrid", fp8_recipe="tensorwise"), "--fp8-format hybrid needs Transformer Engine on a GPU"),
    (H200, dict(fp8="hybrid"), "--fp8-recipe delayed all-reduces amax over the whole DP x CP domain"),
    (H200, dict(fp8="e4m3", fp8_recipe="mxfp8"), "--fp8-recipe mxfp8 needs a Blackwell GPU"),
    (DeviceFacts(has_gpu=True, has_transformer_engine=True, capability=(9, 0), cuda_version=(12, 8)),
     dict(fp8="hybrid", fp8_recipe="blockwise"), "--fp8-recipe blockwise needs CUDA >= 12.9"),
    (H200, dict(fp8="hybrid", fp8_recipe="custom"), "--fp8-recipe custom is not supported with --dcp"),
    (H200, dict(fp8="hybrid", fp8_recipe="tensorwise", fp8_dot_product_attention=True),
     "fp8_dot_product_attention is not supported with --dcp"),
    (H200, dict(dcp_row_alignment=3), "--dcp-row-alignment must be an even number"),
])
def test_fp8_settings_dcp_cannot_run_are_refused_naming_the_flag(device, overrides, message):
    with pytest.raises(DcpUsageError) as err:
        check_gpu_path(_args(**overrides), device)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_safe_fp8_recipes_pass_and_set_the_row_alignment():
    for recipe, extra in (("tensorwise", {}), ("blockwise", {}), ("delayed", {"tp_only_amax_red": True})):
        check_gpu_path(_args(fp8="hybrid", fp8_recipe=recipe, **extra), H200)
    check_gpu_path(_args(fp8="hybrid", fp8_recipe="mxfp8"),
                   DeviceFacts(has_gpu=True, has_transformer_engine=True, capability=(10, 0), cuda_version=(13, 0)))
    check_gpu_path(_args(dcp=False, fp8="hybrid"), CPU)   # without --dcp: Megatron's business (a warning)
    assert fp8_row_multiple(_args()) == 1
    assert fp8_row_multiple(_args(fp8="hybrid")) == 16
    assert fp8_row_multiple(_args(fp8="hybrid", tensor_model_parallel_size=4, sequence_parallel=True)) == 64
    assert fp8_row_multiple(_args(dcp_row_alignment=8)) == 8


def test_fp8_on_this_cpu_is_refused_through_validate_dcp_args():
    with pytest.raises(DcpUsageError, match="needs Transformer Engine on a GPU"):
        validate_dcp_args(_args(fp8="hybrid", fp8_recipe="tensorwise"))


def test_fp8_without_dcp_on_cpu_is_not_refused_but_said(capsys):
    check_gpu_path(_args(dcp=False, fp8="hybrid"), CPU)
    assert "--fp8-format hybrid has no effect without Transformer Engine on a GPU" in capsys.readouterr().out
    check_gpu_path(_args(dcp=False, fp8="hybrid"), H200)
    assert capsys.readouterr().out == ""


def test_gradient_accumulation_fusion_is_turned_off_without_apex_and_said(capsys):
    args = _args(gradient_accumulation_fusion=True)
    check_gpu_path(args, DeviceFacts(has_gpu=True, has_transformer_engine=True, capability=(9, 0)))
    assert args.gradient_accumulation_fusion is False
    assert "fused_weight_gradient_mlp_cuda is not installed" in capsys.readouterr().out
    args = _args(gradient_accumulation_fusion=True)
    check_gpu_path(args, H200)           # apex's kernel present: Megatron's default stays
    assert args.gradient_accumulation_fusion is True


def test_fp8_with_dcp_stops_at_start_on_cpu_with_one_line(tmp_path, monkeypatch, capsys):
    """`--fp8-format hybrid --dcp` (the crash of issue 19) through the launcher: exit 2, one line, no process group."""
    from dcp_megatron import launch
    from tests.support.megatron_runs import CPU_FLAGS, LLAMA_TINY, OUR_SCRIPT

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(SystemExit) as exited:
        launch.main([OUR_SCRIPT, *LLAMA_TINY, *CPU_FLAGS, "--train-iters", "4", "--dcp",
                     "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"])
    err = capsys.readouterr().err
    assert exited.value.code == 2, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("dcp: error: ")]
    assert len(lines) == 1 and "--fp8-format hybrid needs Transformer Engine on a GPU" in lines[0], err[-2000:]
    assert "Traceback" not in err and not torch.distributed.is_initialized()


# --- FP8 row alignment -----------------------------------------------------------------------------------------

def _docs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.stack([torch.randint(1, 64, (n,), generator=g), torch.randint(1, 64, (n,), generator=g),
                         torch.ones(n, dtype=torch.int64)], dim=1) for n in lengths]


@pytest.mark.parametrize("lengths, cp_size, pad_multiple, row_multiple", [
    ((5, 12), 1, 1, 16), ((7,), 2, 1, 16), ((3, 9, 30), 3, 1, 16), ((5, 11), 2, 2, 32), ((16,), 1, 1, 16),
    ((), 1, 1, 16)])
def test_row_alignment_pads_with_a_masked_filler_document(lengths, cp_size, pad_multiple, row_multiple):
    docs = _docs(lengths)
    plain = [build_batch(docs, cp_size=cp_size, cp_rank=r, group=None, recompute=NO_RECOMPUTE, wave_index=0,
                         device="cpu", pad_multiple=pad_multiple) for r in range(cp_size)]
    aligned = [build_batch(docs, cp_size=cp_size, cp_rank=r, group=None, recompute=NO_RECOMPUTE, wave_index=0,
                           device="cpu", pad_multiple=pad_multiple, row_multiple=row_multiple) for r in range(cp_size)]
    for before, after in zip(plain, aligned):
        rows = after["tokens"].shape[1]
        assert rows % row_multiple == 0 and rows - before["tokens"].shape[1] < row_multiple
        # the documents' rows and masks are unchanged; the filler's rows carry no loss
        n = before["tokens"].shape[1]
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            assert torch.equal(after[key][:, :n], before[key]), key
        assert after["loss_mask"][:, n:].sum() == 0
        assert after["loss_mask"].sum() == before["loss_mask"].sum()
        # the filler is a document of its own (attends only to itself), identical on every rank of the group
        assert torch.equal(after["cu_seqlens_padded"][:, :-1], before["cu_seqlens_padded"]) or rows == n
        assert torch.equal(after["cu_seqlens_padded"], aligned[0]["cu_seqlens_padded"])
        # what TE's p2p ring needs of THD under CP: every (padded) document a multiple of 2 x CP size
        assert all(int(n) % (2 * cp_size) == 0 for n in after["cu_seqlens_padded"].diff(dim=1).view(-1))
        assert int(after["cu_seqlens_padded"][0, -1]) == cp_size * rows
    assert aligned_filler_rows(32, row_multiple=16) == 0 and aligned_filler_rows(6, row_multiple=1) == 0


def _alignment_worker(rank: int, world_size: int) -> dict:
    """Loss and gradients of a tiny GPT on the same micro-batches with and without the row alignment; and which
    checkpoint full recompute takes under FP8 (config.fp8 set; TE's checkpoint observed, run as Megatron's own)."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core import recompute as core_recompute
    from megatron.core.packed_seq_params import PackedSeqParams

    from tests.support.megatron_runs import tiny_local_gpt
    from patches.megatron_set import megatron_patch_registry
    from dcp_megatron.core.recompute import apply_recompute

    with megatron_patch_registry():
        parallel_state.initialize_model_parallel()
        model = tiny_local_gpt(num_layers=2, max_sequence_length=64)
        config = model.config
        microbatches = [_docs((5, 12), seed=1), _docs((21,), seed=2), _docs((3, 4, 9), seed=3)]

        def step(row_multiple: int, recompute: Recompute = NO_RECOMPUTE) -> tuple[float, dict, list]:
            model.zero_grad(set_to_none=True)
            total, rows = 0.0, []
            for docs in microbatches:
                batch = build_batch(docs, cp_size=1, cp_rank=0, group=None, recompute=recompute, wave_index=0,
                                    device="cpu", row_multiple=row_multiple)
                apply_recompute(model, recompute)
                bounds = batch["cu_seqlens_padded"].view(-1)
                params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds,
                                         cu_seqlens_q_padded=bounds, cu_seqlens_kv_padded=bounds,
                                         max_seqlen_q=int(batch["max_seqlen"]), max_seqlen_kv=int(batch["max_seqlen"]))
                losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                               packed_seq_params=params)
                loss = (losses.view(-1).float() * batch["loss_mask"].view(-1)).sum()
                loss.backward()
                total += float(loss)
                rows.append(int(batch["tokens"].shape[1]))
            # numpy: tensors would cross the result queue as shared memory that dies with this process
            return total, {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()}, rows

        results = {"plain": step(1), "aligned": step(16)}
        seen = []
        # te_checkpoint is None without TE; Megatron's block recompute calls it whenever config.fp8 is set
        original = core_recompute.te_checkpoint

        def observed_te_checkpoint(function, distribute, rng_tracker, tp_group, *args, **kwargs):
            seen.append("te_checkpoint")
            return tensor_parallel.checkpoint(function, distribute, *args, **kwargs)

        core_recompute.te_checkpoint = observed_te_checkpoint
        config.fp8 = "hybrid"
        try:
            results["fp8_full"] = step(16, Recompute("full", 2))
        finally:
            config.fp8 = None
            core_recompute.te_checkpoint = original
        results["te_checkpoint_calls"] = len(seen)
        parallel_state.destroy_model_parallel()
    return results


def test_row_alignment_changes_no_loss_or_gradient_and_fp8_recompute_takes_te_checkpoint():
    results = run_distributed(_alignment_worker, 1)[0]
    (loss, grads, rows), (aligned_loss, aligned_grads, aligned_rows) = results["plain"], results["aligned"]
    assert rows != aligned_rows and all(r % 16 == 0 for r in aligned_rows)   # the alignment really padded
    assert aligned_loss == pytest.approx(loss, rel=1e-6)
    for name, grad in grads.items():
        assert np.allclose(aligned_grads[name], grad, rtol=1e-5, atol=1e-7), name
    # full recompute of 2 layers under FP8: Megatron's TE checkpoint path, in every micro-batch, same numbers
    assert results["te_checkpoint_calls"] == 2 * 3   # block recompute checkpoints each of the 2 layers
    fp8_loss, fp8_grads, _ = results["fp8_full"]
    assert fp8_loss == pytest.approx(loss, rel=1e-6)
    for name, grad in grads.items():
        assert np.allclose(fp8_grads[name], grad, rtol=1e-5, atol=1e-7), name


# --- the CP stream ---------------------------------------------------------------------------------------------

def test_cp_stream_is_made_lazily_on_the_current_device_once_per_device(monkeypatch):
    import patches.extensions_transformer_engine as te_patch

    made, current = [], {"device": 3}
    stream = te_patch.PerDeviceStream(make_stream=lambda device: made.append(device) or f"stream@{device}",
                                      current_device=lambda: current["device"])

    class Attention:   # stands in for TEDotProductAttention's class attribute
        cp_stream = stream

    assert made == []                                   # nothing at patch time (before set_device)
    assert Attention.cp_stream == "stream@3" and Attention().cp_stream == "stream@3" and made == [3]
    current["device"] = 1
    assert Attention.cp_stream == "stream@1" and made == [3, 1]
    current["device"] = 3
    assert Attention.cp_stream == "stream@3" and made == [3, 1]
    held = Attention()
    held.cp_stream = "given"                            # TE stores the stream it is handed on the instance
    assert held.cp_stream == "given" and Attention.cp_stream == "stream@3"
    # The patch set on a GPU machine with TE: registered without making any stream (the old patch made one here).
    monkeypatch.setattr(te_patch, "te_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: pytest.fail("a CUDA stream was made at patch time"))
    patches = {patch.target.rsplit(":", 1)[1]: patch for patch in te_patch.dcp_patches()}
    assert sorted(patches) == ["TEDotProductAttention.cp_stream", "te_checkpoint"]
    assert isinstance(patches["TEDotProductAttention.cp_stream"].replacement, te_patch.PerDeviceStream)


def test_fp8s_checkpoint_never_hands_back_a_parameter():
    """The MLP's recompute under FP8 runs through megatron's `te_checkpoint`: the patched one hands TE a function
    that returns a copy of the MLP's bias Parameter, never the Parameter (patches/tensor_parallel_random.py)."""
    from patches import extensions_transformer_engine as te_patch

    weight, bias = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.zeros(2))
    handed = {}

    def te_checkpoint(forward_func, distribute, rng_tracker, tp_group, *args, **kwargs):   # as TE runs it
        handed["args"] = (distribute, rng_tracker, tp_group, kwargs)
        with torch.no_grad():
            return forward_func(*args)

    patched = te_patch._te_checkpoint_without_leaf_outputs(te_checkpoint)
    out, returned_bias = patched(lambda x: (x @ weight, bias), False, "tracker", "tp", torch.ones(1, 2), flag=1)
    assert returned_bias is not bias and torch.equal(returned_bias, bias) and torch.equal(out, torch.full((1, 2), 2.))
    assert handed["args"] == (False, "tracker", "tp", {"flag": 1}) and patched.dcp_original is te_checkpoint


# --- DeepSpeed -------------------------------------------------------------------------------------------------

def test_deepspeed_bf16_optimizer_config_is_refused_and_adam_is_torchs():
    pytest.importorskip("deepspeed")
    from dcp_megatron.deepspeed.config import prepare_deepspeed_config, torch_adam_params

    config = {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"},
              "zero_optimization": {"stage": 1}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    with pytest.raises(DcpUsageError, match="BF16_Optimizer.*use ZeRO stage 2, or remove \"grad_accum_dtype\""):
        prepare_deepspeed_config(config)
    prepare_deepspeed_config({**config, "zero_optimization": {"stage": 2}})
    prepare_deepspeed_config({**config, "data_types": {}})
    gpu = torch_adam_params({"type": "AdamW", "params": {"lr": 1e-3}}, has_gpu=True)["params"]
    assert gpu == {"lr": 1e-3, "torch_adam": True, "fused": True}
    cpu = torch_adam_params({"type": "Adam"}, has_gpu=False)["params"]
    assert cpu == {"torch_adam": True}
    assert torch_adam_params({"type": "Lamb", "params": {}}, has_gpu=True) == {"type": "Lamb", "params": {}}


_STALE_LOCK_RUN = textwrap.dedent("""
    import os, sys
    from datetime import timedelta
    from torch.utils.cpp_extension import _get_build_directory
    build = _get_build_directory("deepspeed_shm_comm", verbose=False)
    open(os.path.join(build, "lock"), "w").close()      # left by a process killed while compiling
    from patches.deepspeed_set import deepspeed_patch_registry
    import deepspeed, torch
    timeout = timedelta(seconds=60)
    registry = deepspeed_patch_registry(timeout=timeout).apply() if sys.argv[1] == "patched" else None
    deepspeed.init_distributed(dist_backend="gloo", timeout=timeout)
    print("initialized", torch.distributed.get_world_size(), flush=True)
    torch.distributed.destroy_process_group()
""")


def test_deepspeed_starts_with_a_stale_shm_comm_build_lock(tmp_path):
    pytest.importorskip("deepspeed")
    from tests.support.dist_utils import free_port

    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "DS_ACCELERATOR": "cpu", "RANK": "0",
           "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))}
    run = subprocess.run([sys.executable, "-c", _STALE_LOCK_RUN, "patched"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and "initialized 1" in run.stdout, run.stderr[-3000:]
    assert "deepspeed_shm_comm" not in run.stdout + run.stderr   # not built, not waited for


@pytest.mark.slow
def test_row_alignment_and_the_apex_switch_end_to_end_leave_the_loss_trace_and_grad_norms_unchanged():
    """Megatron's loop, 1 rank: --dcp against --dcp --dcp-row-alignment 16 without --no-gradient-accumulation-fusion
    (no GPU here: the CPU defaults turn the fusion off and say so; on a GPU without apex --dcp's switch does, which
    test_gradient_accumulation_fusion_is_turned_off_without_apex_and_said covers): never a failure at model build."""
    from tests.support.megatron_runs import (CPU_FLAGS, LLAMA_TINY, OUR_SCRIPT, REPO, parse_output, run_env,
                                     torchrun_command)

    def train(cpu_flags, extra):
        command = torchrun_command(OUR_SCRIPT, [*LLAMA_TINY, *cpu_flags, "--train-iters", "4", "--dcp", *extra],
                                   nproc=1, launcher=False)
        proc = subprocess.run(command, cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=600)
        return parse_output(proc.returncode, proc.stdout + proc.stderr)

    plain = train(CPU_FLAGS, []).check()
    aligned = train([f for f in CPU_FLAGS if f != "--no-gradient-accumulation-fusion"],
                    ["--dcp-row-alignment", "16"]).check()
    notice = next(line for line in aligned.output.splitlines() if line.startswith("dcp: no GPU found"))
    assert "--no-gradient-accumulation-fusion" in notice
    assert sorted(aligned.losses) == sorted(plain.losses) == [1, 2, 3, 4]
    for step in plain.losses:
        assert aligned.losses[step] == pytest.approx(plain.losses[step], rel=1e-5)
        assert aligned.grad_norms[step] == pytest.approx(plain.grad_norms[step], rel=1e-4)
