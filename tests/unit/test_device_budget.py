"""The GPU read at start (costmodel/device_budget.py, runtime/device_memory.py), on CPU with made-up readings: the
cluster preset by the device's name, the default budget from the device's memory (not an H200's on every GPU), a
--dcp-memory-budget-gb above the device kept with one line, --dcp-device-memory-gb as the cap and the budget."""
from __future__ import annotations

import argparse

import pytest

from dcp_megatron.config import DcpConfig
from dcp_megatron.core.planning import build_cost_model, model_shape_from_args
from dcp_megatron.planner.costmodel import GiB, cluster_preset
from dcp_megatron.planner.costmodel.device_budget import DeviceReading, choose_device_budget, preset_for_device

# what torch reports for these cards (total_memory in bytes)
H100 = DeviceReading(name="NVIDIA H100 80GB HBM3", total_bytes=85_520_809_984, free_bytes=80_000_000_000,
                     allocated_bytes=2 * GiB, reserved_bytes=3 * GiB)
A100_40 = DeviceReading(name="NVIDIA A100-SXM4-40GB", total_bytes=42_505_273_344, free_bytes=35 * GiB,
                        allocated_bytes=5 * GiB, reserved_bytes=5 * GiB)
UNKNOWN = DeviceReading(name="Tesla V100-SXM2-32GB", total_bytes=34_089_730_048, free_bytes=30 * GiB,
                        allocated_bytes=0, reserved_bytes=0)


@pytest.mark.parametrize("name, total_gb, preset", [
    ("NVIDIA H100 80GB HBM3", 80, "h100-sxm"), ("NVIDIA H100 PCIe", 80, "h100-pcie"), ("NVIDIA H200", 141, "h200"),
    ("NVIDIA A100-SXM4-40GB", 40, "a100-40gb"), ("NVIDIA A100 80GB PCIe", 80, "a100-80gb"), ("NVIDIA B200", 180, "b200"),
])
def test_the_preset_is_the_devices(name, total_gb, preset):
    assert preset_for_device(name, total_gb * 10 ** 9) == (preset, None)
    assert cluster_preset(preset, domain_size=8).mem_bytes_per_gpu > 0


def test_an_unknown_device_gets_the_nearest_preset_and_a_note_naming_dcp_profile():
    preset, note = preset_for_device(UNKNOWN.name, UNKNOWN.total_bytes)
    assert preset == "a100-40gb"    # 34 GB: nearest by memory
    assert "Tesla V100" in note and "dcp-profile" in note and note.count("\n") == 0


def _model(**flags):
    base = {"num_layers": 4, "hidden_size": 1024, "num_attention_heads": 8, "group_query_attention": False,
            "kv_channels": 128, "ffn_hidden_size": 2816, "padded_vocab_size": 32768, "swiglu": True,
            "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
            "transformer_impl": "transformer_engine", "fp8": None, "bf16": True}
    return model_shape_from_args(argparse.Namespace(**{**base, **flags}))


def _cost(reading, **config):
    lines: list[str] = []
    cost = build_cost_model(DcpConfig(seq_length=4096, **config), _model(), domain_size=8, has_gpu=True,
                            device=reading, say=lines.append)
    return cost, lines


def test_an_80gb_h100_plans_for_its_own_memory_not_an_h200s():
    cost, lines = _cost(H100)
    assert cost.cluster.name == "h100-sxm"
    # the run holds less than the count's static bytes: the budget is all torch can reach (free + its cache)
    assert H100.allocated_bytes < cost.static_bytes
    assert cost.cluster.mem_bytes_per_gpu == H100.free_bytes + H100.reserved_bytes
    assert cost.cluster.mem_bytes_per_gpu < 80 * GiB < cluster_preset("h200", domain_size=8).mem_bytes_per_gpu
    assert len(lines) == 1 and "NVIDIA H100 80GB HBM3" in lines[0] and "h100-sxm" in lines[0]
    assert f"budget {cost.cluster.mem_bytes_per_gpu / GiB:.2f} GiB" in lines[0]


def test_a_40gb_a100_budget_is_less_what_the_run_holds_beyond_the_count():
    cost, lines = _cost(A100_40)
    assert cost.cluster.name == "a100-40gb"
    uncounted = A100_40.allocated_bytes - cost.static_bytes
    assert uncounted > 0
    assert cost.cluster.mem_bytes_per_gpu == A100_40.free_bytes + A100_40.reserved_bytes - uncounted
    assert cost.cluster.fp8_gemm_flops == 0   # no FP8 on an A100


def test_an_unknown_device_plans_with_the_nearest_preset_and_says_so():
    cost, lines = _cost(UNKNOWN)
    assert cost.cluster.name == "a100-40gb" and cost.cluster.mem_bytes_per_gpu == UNKNOWN.free_bytes
    assert len(lines) == 2 and "dcp-profile" in lines[1]


def test_a_budget_above_the_device_is_kept_and_said_in_one_line():
    cost, lines = _cost(H100, memory_budget_gb=120)
    assert cost.cluster.mem_bytes_per_gpu == 120 * GiB      # kept: plans may overrun (the run survives OOMs)
    assert len(lines) == 2 and "--dcp-memory-budget-gb 120 is above what the device" in lines[1]
    cost, lines = _cost(H100, memory_budget_gb=40)
    assert cost.cluster.mem_bytes_per_gpu == 40 * GiB and len(lines) == 1


def test_the_device_memory_cap_bounds_the_budget_and_a_budget_above_it_is_said():
    capped = DeviceReading(name=H100.name, total_bytes=H100.total_bytes, free_bytes=H100.free_bytes,
                           allocated_bytes=H100.allocated_bytes, reserved_bytes=H100.reserved_bytes, cap_bytes=20 * GiB)
    cost, lines = _cost(capped, device_memory_gb=20)
    assert cost.cluster.mem_bytes_per_gpu == 20 * GiB and "--dcp-device-memory-gb 20" in lines[0]
    cost, lines = _cost(capped, device_memory_gb=20, memory_budget_gb=30)
    assert cost.cluster.mem_bytes_per_gpu == 30 * GiB
    assert "above what --dcp-device-memory-gb 20" in lines[1]


def test_on_cpu_the_device_memory_is_the_default_budget():
    none = choose_device_budget(None, static_bytes=0, memory_budget_gb=None, device_memory_gb=None, safety_frac=0.1)
    assert none.mem_bytes_per_gpu is None and none.lines == ()    # the cpu preset's
    given = choose_device_budget(None, static_bytes=0, memory_budget_gb=None, device_memory_gb=0.5, safety_frac=0.1)
    assert given.mem_bytes_per_gpu == GiB // 2
    over = choose_device_budget(None, static_bytes=0, memory_budget_gb=1, device_memory_gb=0.5, safety_frac=0.1)
    assert over.mem_bytes_per_gpu == GiB and "above what --dcp-device-memory-gb 0.5" in over.lines[0]
    cost = build_cost_model(DcpConfig(seq_length=64, device_memory_gb=0.5), _model(transformer_impl="local",
                            bf16=False), domain_size=2, has_gpu=False)
    assert cost.cluster.name == "cpu" and cost.cluster.mem_bytes_per_gpu == GiB // 2


def test_the_reading_and_the_cap_call_torch_on_the_ranks_device(monkeypatch):
    """runtime/device_memory.py on a fake CUDA: LOCAL_RANK's device, the fraction that caps at G."""
    import torch

    from dcp_megatron.runtime import device_memory

    calls = {}
    props = argparse.Namespace(name="NVIDIA H100 80GB HBM3", total_memory=H100.total_bytes)
    fraction = {"value": 1.0}
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: calls.setdefault("props", d) and props)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (H100.free_bytes, H100.total_bytes))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: H100.allocated_bytes)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: H100.reserved_bytes)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda d: fraction["value"])

    def set_fraction(value, d):
        calls["fraction"] = (value, d)
        fraction["value"] = value
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
    assert device_memory.read_device() == H100
    assert calls["props"] == 1
    assert device_memory.cap_device_memory(20) is None
    assert calls["fraction"] == (20 * GiB / H100.total_bytes, 1)
    assert device_memory.read_device().cap_bytes == pytest.approx(20 * GiB, abs=1)
    assert "no cap set" in device_memory.cap_device_memory(100)


def test_both_engines_cap_through_one_call_on_gpu_only(monkeypatch):
    from dcp_megatron.runtime import device_memory

    capped, said = [], []
    monkeypatch.setattr(device_memory, "cap_device_memory", lambda gb: capped.append(gb) or "no cap: bigger")
    device_memory.cap_for_run(20.0, has_gpu=False, say=said.append)
    device_memory.cap_for_run(None, has_gpu=True, say=said.append)
    assert capped == [] and said == []
    device_memory.cap_for_run(20.0, has_gpu=True, say=said.append)
    assert capped == [20.0] and said == ["no cap: bigger"]
