"""`--dcp-recompute`, `--dcp-memory-budget-gb` and `--dcp-max-cp-size` reach the cost model every plan is made by,
on both engines (Megatron's flags through `dcp_config_from_args`; the DeepSpeed script's flags and its JSON's "dcp"
block through its own set-up): a flag parsed but never handed on would leave the preset's menu and memory, which
only a multi-minute training run showed before."""
from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from dcp_megatron.config import DEFAULT_RECOMPUTE
from dcp_megatron.core.planning import build_cost_model
from dcp_megatron.planner.costmodel import GiB, cluster_preset, model_preset
from dcp_megatron.planner.plan import NO_RECOMPUTE

GIVEN = {"recompute": ("none", "mlp"), "memory_budget_gb": 0.25, "max_cp_size": 2, "device_memory_gb": 0.5}
FLAGS = ["--dcp-recompute", "none,mlp", "--dcp-memory-budget-gb", "0.25", "--dcp-max-cp-size", "2",
         "--dcp-device-memory-gb", "0.5"]


def _assert_reached(config) -> None:
    cost = build_cost_model(config, model_preset("llama3-8b"), domain_size=4, has_gpu=False)
    preset = cluster_preset("cpu", domain_size=4, gpus_per_node=config.gpus_per_node)
    # the premise: each given value differs from what the cost model would hold without it
    assert set(GIVEN["recompute"]) != set(DEFAULT_RECOMPUTE)
    assert preset.mem_bytes_per_gpu != int(0.25 * GiB) and preset.max_cp_size != 2
    assert set(cost.allowed_recompute) == set(GIVEN["recompute"]), cost.allowed_recompute
    assert cost.cluster.mem_bytes_per_gpu == int(0.25 * GiB)
    assert cost.cluster.max_cp_size == 2
    assert config.device_memory_gb == 0.5   # the runtime reads it from the config (the cap, the emulated device)


def test_megatrons_dcp_flags_reach_the_cost_model():
    from dcp_megatron.flags.dcp_flags import add_dcp_arguments, dcp_config_from_args

    args = add_dcp_arguments(argparse.ArgumentParser()).parse_args(["--dcp", *FLAGS])
    vars(args).update(seq_length=1024, log_interval=1, train_iters=4)
    _assert_reached(dcp_config_from_args(args))


@pytest.mark.parametrize("where", ["flags", "json"])
def test_the_deepspeed_scripts_dcp_flags_and_json_block_reach_the_cost_model(where, tmp_path, monkeypatch):
    from dcp_megatron.deepspeed.arguments import parse_args
    from dcp_megatron.deepspeed.setup import deepspeed_setup
    from tests.support.deepspeed_runs import TINY_MODEL, ds_config

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")   # the domain --dcp-max-cp-size is checked against
    config = dict(ds_config(stage=1, total_steps=9))
    flags = ["--dcp", *FLAGS]
    if where == "json":
        config["dcp"] = {"enabled": True, "recompute": list(GIVEN["recompute"]),
                         "memory_budget_gb": GIVEN["memory_budget_gb"], "max_cp_size": GIVEN["max_cp_size"],
                         "device_memory_gb": GIVEN["device_memory_gb"]}
        flags = []
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    args = parse_args([*TINY_MODEL, "--deepspeed-config", str(path), "--train-iters", "9", *flags])
    _, dcp = deepspeed_setup(args, has_gpu=False)
    _assert_reached(dcp)


@pytest.mark.parametrize("run", [{}, {"bias_swiglu_fusion": False}, {"bf16": True},
                                 {"transformer_impl": "transformer_engine"}])
def test_the_cpu_count_is_the_model_shape_of_a_cpu_fp32_local_run_only(run):
    """A CPU fp32 local-spec run is counted as it runs (memory_spec.CPU_FP32, mlp.py's glu unfused where asked);
    a run it does not describe is counted with Transformer Engine's spec."""
    from dcp_megatron.core.planning import model_shape_from_args
    from dcp_megatron.flags.dcp_flags import add_dcp_arguments
    from dcp_megatron.planner.costmodel.memory_spec import CPU_FP32, TRANSFORMER_ENGINE

    def shape(flags):
        args = add_dcp_arguments(argparse.ArgumentParser()).parse_args(["--dcp", *flags])
        vars(args).update({"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                           "group_query_attention": False, "kv_channels": 16, "ffn_hidden_size": 128,
                           "padded_vocab_size": 256, "swiglu": True, "tensor_model_parallel_size": 1,
                           "pipeline_model_parallel_size": 1, "transformer_impl": "local", **run})
        return model_shape_from_args(args)

    expected = {"{}": CPU_FP32, str({"bias_swiglu_fusion": False}): dataclasses.replace(CPU_FP32, swiglu="unfused"),
                # TE's spec in Megatron's default precision (fp32): its tensors at 4 bytes
                str({"transformer_impl": "transformer_engine"}): dataclasses.replace(TRANSFORMER_ENGINE, dtype_bytes=4)}
    assert shape([]).activations == expected.get(str(run), TRANSFORMER_ENGINE)


def test_a_gpu_run_counts_with_the_spec_of_the_layers_it_runs(monkeypatch):
    """A GPU run is counted with the spec it builds: TE's for --transformer-impl transformer_engine (its FP8
    linears' under --fp8-format), the local spec's bf16 count for local."""
    import torch

    from dcp_megatron.core.planning import activation_spec_of
    from dcp_megatron.planner.costmodel.memory_spec import LOCAL_BF16, TRANSFORMER_ENGINE, TRANSFORMER_ENGINE_FP8

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    te = dict(transformer_impl="transformer_engine", bf16=True)
    assert activation_spec_of(argparse.Namespace(**te, fp8=None)) == TRANSFORMER_ENGINE
    assert activation_spec_of(argparse.Namespace(**te, fp8="hybrid")) == TRANSFORMER_ENGINE_FP8
    assert activation_spec_of(argparse.Namespace(transformer_impl="local", bf16=True)) == LOCAL_BF16
    assert activation_spec_of(argparse.Namespace(transformer_impl="local", fp16=True)) == LOCAL_BF16


@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_a_gpu_run_without_bf16_is_counted_at_4_bytes(impl, monkeypatch):
    """Megatron's default precision is fp32: a GPU run without --bf16 / --fp16 keeps 4 bytes per element of every
    activation the spec keeps in the run's dtype, and its count says so (the d-typed tensors twice the bf16 run's);
    --bf16 and --fp16 are counted at 2. The DeepSpeed script passes its JSON's precision (dtype_bytes)."""
    import torch

    from dcp_megatron.core.planning import activation_spec_of, model_shape_from_args
    from dcp_megatron.planner.costmodel import CostModel, cluster_preset

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    flags = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "group_query_attention": False,
             "kv_channels": 16, "ffn_hidden_size": 128, "padded_vocab_size": 256, "swiglu": True,
             "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "transformer_impl": impl, "fp8": None}
    fp32, bf16, fp16 = (model_shape_from_args(argparse.Namespace(**flags, **extra))
                        for extra in ({}, {"bf16": True}, {"fp16": True}))
    assert fp32.activations.dtype_bytes == 4 and bf16.activations.dtype_bytes == 2 == fp16.activations.dtype_bytes
    assert activation_spec_of(argparse.Namespace(**flags), dtype_bytes=2) == bf16.activations
    cluster = cluster_preset("h100-sxm", domain_size=1)
    per_token = {name: CostModel(shape, cluster).held_bytes_per_local_token(NO_RECOMPUTE)
                 for name, shape in (("fp32", fp32), ("bf16", bf16))}
    # the d-typed tensors twice as wide; the norms' fp32 tensors and the fp32 logits' copy keep it under twice
    assert 1.25 * per_token["bf16"] < per_token["fp32"] < 2 * per_token["bf16"], per_token
