"""Activation offload per micro-batch (dcp_megatron/core/offload.py, the offload-manager patch, the start checks).

Offload itself needs CUDA (tools/gpu_check.sh runs it on an H200); here, on CPU: the switch sets exactly each
micro-batch's plan set on megatron-core's own attribute names for its forward step and nothing at rest, the
manager's patched reset makes every DCP step its own warm-up, and where offload cannot run it is refused in
one line.
"""
from __future__ import annotations

import argparse
import inspect
import re
from collections import deque
from types import SimpleNamespace

import pytest
import torch

from dcp_megatron.config import OFFLOAD_REFUSAL, DcpConfig, DcpUsageError
from dcp_megatron.core.microbatch_facts import MICROBATCH_KEY, MicroBatchFacts
from dcp_megatron.core.offload import (DCP_STEPS_ATTR, apply_offload, offload_on, own_warmup_every_step,
                                       switch_offload, switchable_offloads)
from dcp_megatron.flags.fp8_checks import DeviceFacts
from dcp_megatron.planner.plan import Recompute
from dcp_megatron.planner.costmodel.relief import ATTENTION_OFFLOADS, MOE_OFFLOADS
from dcp_megatron.training.checks.offload_checks import check_offload

ATTENTION, ATTN_PROJ = frozenset({"core_attn"}), frozenset({"core_attn", "attn_proj"})


class _Module(torch.nn.Module):
    def __init__(self, **attributes) -> None:
        super().__init__()
        for name, value in attributes.items():
            setattr(self, name, value)


def _layer(*, moe: bool):
    """A layer carrying megatron-core 0.19.2's attribute names (checked against its source below), offload on as
    built with --offload-modules."""
    attention = _Module(offload_core_attention=True, offload_attn_proj=True, checkpoint_core_attention=False)
    if moe:
        mlp = _Module(experts=_Module(offload_expert_fc1=True, offload_moe_act=True, activation_recompute=False),
                      moe_layer_recompute=False, shared_experts_recompute=False)
    else:
        mlp = _Module()
    return _Module(self_attention=attention, mlp=mlp, is_moe_layer=moe, recompute_mlp=False,
                   recompute_input_layernorm=False, recompute_pre_mlp_layernorm=False)


def _model(*, moe: bool = False, layers: int = 2):
    model = _Module(decoder=_Module(layers=torch.nn.ModuleList([_layer(moe=moe) for _ in range(layers)])))
    model.config = SimpleNamespace(fine_grained_activation_offloading=True, recompute_granularity=None,
                                   recompute_method=None, recompute_num_layers=None)
    model.decoder.config = model.config   # one object, as GPTModel hands its config to its decoder
    return model


def test_the_switches_are_megatron_cores_own_attributes_read_at_forward():
    from megatron.core.transformer.attention import Attention
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    init, forward = inspect.getsource(Attention.__init__), inspect.getsource(Attention.forward)
    for attribute, name in (("offload_core_attention", "core_attn"), ("offload_attn_proj", "attn_proj")):
        assert f'self.{attribute} = (' in init and f'"{name}" in self.config.offload_modules' in init
        assert f"self.{attribute}" in forward
    experts = inspect.getsource(TEGroupedMLP)
    for attribute, name in (("offload_expert_fc1", "expert_fc1"), ("offload_moe_act", "moe_act")):
        assert f'"{name}" in self.config.offload_modules' in experts
        assert re.search(rf"off_interface\(\s*self\.{attribute},", experts), attribute   # read at forward
    # every offload the planner's menu plans is switchable on a MoE layer of that shape
    menu = set().union(*ATTENTION_OFFLOADS, *MOE_OFFLOADS)
    assert switchable_offloads(list(_model(moe=True).decoder.layers)) == menu


def test_apply_offload_sets_exactly_the_plans_set_and_refuses_what_the_layers_cannot_offload():
    model = _model(moe=True)
    layers = list(model.decoder.layers)
    for offload in (frozenset(), ATTENTION, ATTN_PROJ, frozenset({"expert_fc1"}), frozenset({"core_attn", "moe_act"})):
        apply_offload(model, offload)
        assert offload_on(layers) == offload
        for layer in layers:   # the very attributes megatron-core's forwards read
            attention, experts = layer.self_attention, layer.mlp.experts
            assert (attention.offload_core_attention, attention.offload_attn_proj, experts.offload_expert_fc1,
                    experts.offload_moe_act) == tuple(n in offload for n in ("core_attn", "attn_proj", "expert_fc1",
                                                                             "moe_act"))
    dense = _model(moe=False)
    with pytest.raises(ValueError, match="cannot offload"):
        apply_offload(dense, frozenset({"expert_fc1"}))
    not_built = _model()
    not_built.config.fine_grained_activation_offloading = False
    with pytest.raises(ValueError, match="built without --fine-grained-activation-offloading"):
        switch_offload([not_built], not_built.config, ATTENTION)
    switch_offload([not_built], not_built.config, frozenset())   # nothing to switch: no error


def _facts(offload: frozenset, *, modules=frozenset(), index: int = 0) -> MicroBatchFacts:
    recompute = Recompute("selective" if modules else "none", modules=frozenset(modules), offload=offload)
    return MicroBatchFacts(wave_index=0, cp_size=1, cp_rank=0, group=None, recompute=recompute,
                           microbatch_index=index)


@pytest.mark.parametrize("moe", [False, True])
def test_each_microbatch_offloads_its_own_set_for_its_forward_and_nothing_at_rest(moe):
    from dcp_megatron.training.forward_step import DcpForwardStep

    model = _model(moe=moe)
    layers = list(model.decoder.layers)
    sets = [frozenset(), ATTENTION, ATTN_PROJ, frozenset(), ATTENTION]
    if moe:
        sets += [frozenset({"expert_fc1"}), frozenset({"core_attn", "expert_fc1", "moe_act"})]
    modules = [frozenset({"mlp"} if not moe else {"moe"}) if not s else frozenset() for s in sets]
    batches = [{MICROBATCH_KEY: _facts(s, modules=m, index=i)} for i, (s, m) in enumerate(zip(sets, modules))]
    seen = []

    def user_step(data_iterator, chunk):
        batch = next(data_iterator)
        seen.append((batch[MICROBATCH_KEY].microbatch_index, offload_on(layers)))
        return torch.zeros(()), None

    step = DcpForwardStep(user_step, batches, model_chunks=[model], config=model.config)
    at_rest = []
    for _ in batches:
        step(None, model)
        at_rest.append(offload_on(layers))   # what a recompute replay in backward reads
    assert seen == [(i, s) for i, s in enumerate(sets)]
    assert at_rest == [frozenset()] * len(sets)


def _fake_manager(**state):
    calls = []
    manager = SimpleNamespace(_cached_chunks_forward=["c0", "c1"], _cached_chunks_backward=["c0", "c1"],
                              _queue=deque(["c0", "c1"]), _stages=[["c1"]], _is_warmup=False,
                              _delayed_offload_groups=[], post_warmup_callback=lambda: calls.append("frozen"))
    manager.__dict__.update(state)
    return manager, calls


def _patched(target: str):
    from patches.pipeline_parallel_fine_grained_activation_offload import dcp_patches

    (patch,) = [p for p in dcp_patches() if p.target.endswith(target)]
    return patch.replacement


def test_a_dcp_step_is_its_own_offload_warmup_and_other_runs_keep_upstreams_frozen_layout():
    reset = _patched("PipelineOffloadManager.reset")
    chunk = SimpleNamespace(resets=0)
    chunk.reset = lambda: setattr(chunk, "resets", chunk.resets + 1)
    marked, calls = _fake_manager(**{DCP_STEPS_ATTR: True, "_cached_chunks_forward": [chunk],
                                     "_cached_chunks_backward": [chunk], "_is_warmup": True})
    reset(marked)
    assert marked._is_warmup and marked._cached_chunks_forward == [] and marked._cached_chunks_backward == []
    assert not marked._queue and marked._stages is None and calls == []   # no frozen layout, no summary collective
    marked._is_warmup = False                 # a layout an unmarked first step (evaluation) froze: warm up again
    reset(marked)
    assert marked._is_warmup
    upstream, calls = _fake_manager(_cached_chunks_forward=[chunk], _cached_chunks_backward=[chunk], _is_warmup=True)
    reset(upstream)
    assert calls == ["frozen"] and upstream._cached_chunks_forward == [chunk] and chunk.resets == 1


def test_under_dcp_offload_groups_skip_the_per_shape_pinned_pool(monkeypatch):
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import PipelineOffloadManager

    init = _patched("OffloadTensorGroup.__init__")
    monkeypatch.setattr(PipelineOffloadManager, "OFFLOAD_MGR", SimpleNamespace(**{DCP_STEPS_ATTR: True}))
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import OffloadTensorGroup

    group = OffloadTensorGroup.__new__(OffloadTensorGroup)
    init(group, "core_attn")
    assert group.use_cpu_pool is False and group._name == "core_attn"
    monkeypatch.setattr(PipelineOffloadManager, "OFFLOAD_MGR", SimpleNamespace())
    group = OffloadTensorGroup.__new__(OffloadTensorGroup)
    init(group, "core_attn")
    assert group.use_cpu_pool is True   # upstream's choice for an unmarked manager


def test_own_warmup_every_step_marks_the_manager_and_resets_it(monkeypatch):
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import PipelineOffloadManager

    resets = []
    manager = SimpleNamespace(reset=lambda: resets.append(getattr(manager, DCP_STEPS_ATTR, False)))
    monkeypatch.setattr(PipelineOffloadManager, "OFFLOAD_MGR", manager)   # get_instance() hands it out
    own_warmup_every_step()
    assert resets == [True]


def test_offload_is_refused_in_one_line_where_it_cannot_run():
    with pytest.raises(DcpUsageError) as err:
        DcpConfig(seq_length=8, recompute=("none", "offload"))   # DeepSpeed's config road (ZeRO-3 included)
    assert str(err.value) == OFFLOAD_REFUSAL and "\n" not in OFFLOAD_REFUSAL and "GPU only" in OFFLOAD_REFUSAL
    assert DcpConfig(seq_length=8, recompute=("none", "offload"), offload_runs=True).recompute == ("none", "offload")


_GPU = DeviceFacts(has_gpu=True, has_transformer_engine=True)


def _args(**overrides) -> argparse.Namespace:
    args = argparse.Namespace(dcp=True, dcp_recompute="none,full,offload", transformer_impl="transformer_engine",
                              fine_grained_activation_offloading=False, offload_modules=[], num_experts=None,
                              moe_grouped_gemm=False, cuda_graph_impl="none", activation_offload_fraction=1.0,
                              delta_offload_bytes_across_pp_ranks=0, delay_offload_until_cuda_graph=False, rank=0)
    vars(args).update(overrides)
    return args


@pytest.mark.parametrize("overrides, device, message", [
    ({}, DeviceFacts(has_gpu=False, has_transformer_engine=False), "runs on GPU only"),
    (dict(transformer_impl="local"), _GPU, "needs --transformer-impl transformer_engine"),
    (dict(num_experts=4), _GPU, "needs --moe-grouped-gemm"),
    (dict(cuda_graph_impl="transformer_engine"), _GPU, "--cuda-graph-impl transformer_engine conflicts"),
    (dict(activation_offload_fraction=0.5), _GPU, "--activation-offload-fraction 0.5"),
    (dict(offload_modules=["qkv_linear"]), _GPU, "--offload-modules qkv_linear"),
    (dict(dcp_recompute="none,full", fine_grained_activation_offloading=True), _GPU,
     "--fine-grained-activation-offloading conflicts with --dcp"),
])
def test_start_checks_refuse_what_cannot_offload(monkeypatch, overrides, device, message):
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1")
    with pytest.raises(DcpUsageError) as err:
        check_offload(_args(**overrides), device)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_on_gpu_the_layers_are_built_with_every_menu_offload(monkeypatch, capsys):
    monkeypatch.delenv("NVTE_CPU_OFFLOAD_V1", raising=False)
    with pytest.raises(DcpUsageError, match="NVTE_CPU_OFFLOAD_V1=1"):
        check_offload(_args(), _GPU)
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1")
    args = _args()
    check_offload(args, _GPU)
    assert args.fine_grained_activation_offloading and args.offload_modules == ["core_attn", "attn_proj"]
    assert "--fine-grained-activation-offloading" in capsys.readouterr().out
    check_offload(args, _GPU)   # checked again (its own setting): accepted
    moe = _args(num_experts=4, moe_grouped_gemm=True)
    check_offload(moe, _GPU)
    assert moe.offload_modules == ["core_attn", "attn_proj", "expert_fc1", "moe_act"]
    from dcp_megatron.flags.dcp_flags import dcp_config_from_args

    plain = _args(dcp_recompute="none,full")
    check_offload(plain, _GPU)
    assert not plain.fine_grained_activation_offloading   # no offload on the menu: built as upstream
    assert dcp_config_from_args(_full_args(args)).offload_runs   # the run's DcpConfig takes 'offload' then
    with pytest.raises(DcpUsageError, match="runs on GPU only"):
        dcp_config_from_args(_full_args(_args()))   # layers not built with offload: refused


def _full_args(args: argparse.Namespace) -> argparse.Namespace:
    from dcp_megatron.flags.dcp_flags import add_dcp_arguments

    full = add_dcp_arguments(argparse.ArgumentParser()).parse_args([])
    vars(full).update(vars(args), seq_length=64, log_interval=1, fp8=None)
    return full


@pytest.mark.parametrize("built", [True, False])
def test_a_dcp_step_warms_the_offload_manager_up_before_megatrons_schedule_runs(monkeypatch, built):
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import PipelineOffloadManager

    from dcp_megatron.training.schedule import _MegatronStep

    events = []
    manager = SimpleNamespace(reset=lambda: events.append("reset"))
    monkeypatch.setattr(PipelineOffloadManager, "OFFLOAD_MGR", manager)
    model = _model()
    model.config.fine_grained_activation_offloading = built
    model.config.variable_seq_lengths = False
    if not built:
        apply_offload(model, frozenset())   # as upstream builds the layers without --offload-modules
    sets = [ATTENTION, frozenset()] if built else [frozenset(), frozenset()]
    batches = [{MICROBATCH_KEY: _facts(s, index=i)} for i, s in enumerate(sets)]

    def inner(*, forward_step_func, num_microbatches, model, **kwargs):
        events.append(("schedule", getattr(manager, DCP_STEPS_ATTR, False)))
        for _ in range(num_microbatches):
            forward_step_func(None, model)
        return []

    def user_step(data_iterator, chunk):
        events.append(offload_on(list(model.decoder.layers)))
        return torch.zeros(()), None

    owner = SimpleNamespace(inner=inner, has_gpu=False, model_shape=SimpleNamespace(pp=1),
                            loop=SimpleNamespace(measures_memory=lambda: False),
                            config=SimpleNamespace(dump_saved_bytes=None))
    step = _MegatronStep(owner, forward_step_func=user_step, data_iterator=None, model=model, seq_length=8,
                         schedule_kwargs={})
    step.run_batches(batches, share=None)
    # built with offload (GPU): a fresh warm-up, marked, before the schedule; else the manager is never touched
    assert events == (["reset", ("schedule", True)] if built else [("schedule", False)]) + sets
