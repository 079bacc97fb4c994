"""Issue 46: --moe-layer-freq's dense layers are counted as dense (weights, FLOPs), not with the experts."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from dcp_megatron.config import DcpUsageError
from dcp_megatron.planner.costmodel import model_preset



def _moe(num_dense_layers=0, mtp=0):
    return dataclasses.replace(model_preset("deepseek-v3-like"), num_dense_layers=num_dense_layers, mtp_num_layers=mtp)


@pytest.mark.parametrize("mtp", [0, 1])
def test_k_dense_layers_count_between_all_dense_and_all_moe_by_the_right_amounts(mtp):
    moe, dense_k = _moe(mtp=mtp), _moe(3, mtp=mtp)
    dense = dataclasses.replace(moe, num_experts=None, moe_shared_expert_size=None, moe_ffn_hidden_size=None, ep=1)
    per_moe, per_dense = moe.mlp_params_per_layer, moe.dense_mlp_params
    active_moe = moe.active_mlp_params_per_layer
    assert dense_k.linear_params == moe.linear_params - 3 * (per_moe - per_dense)
    assert dense_k.active_linear_params == moe.active_linear_params - 3 * (active_moe - per_dense)
    assert dense_k.expert_params == moe.expert_params - 3 * moe.num_experts * moe.expert_mlp_params
    assert dense_k.num_params == moe.num_params - 3 * (per_moe - per_dense)
    assert dense_k.linear_flops_per_token == 6.0 * dense_k.active_linear_params
    # between the all-dense and the all-MoE model of the same layers
    for name in ("linear_params", "active_linear_params", "num_params"):
        low, high = sorted((getattr(dense, name), getattr(moe, name)))
        assert low < getattr(dense_k, name) < high, name
    all_dense_layers = _moe(moe.num_layers, mtp=mtp)   # every decoder layer dense: only MTP's layers keep experts
    assert all_dense_layers.num_moe_layers == mtp
    assert all_dense_layers.linear_params - dense.linear_params == mtp * (per_moe - per_dense)


@pytest.mark.parametrize("freq, dense", [(1, 0), (2, 2), (3, 2), ([0] * 3 + [1] * 1, 3), ([0, 1] * 2, 2), ("2", 2)])
def test_model_shape_from_args_reads_moe_layer_freq(freq, dense):
    from dcp_megatron.core.planning import dense_layers_of

    assert dense_layers_of(SimpleNamespace(num_layers=4, moe_layer_freq=freq)) == dense


@pytest.mark.parametrize("freq", [[1, 0], [0, 2, 1, 1], 0])
def test_a_moe_layer_freq_that_does_not_name_each_layer_is_refused(freq):
    from dcp_megatron.core.planning import dense_layers_of

    with pytest.raises(DcpUsageError, match="--moe-layer-freq"):
        dense_layers_of(SimpleNamespace(num_layers=4, moe_layer_freq=freq))


def test_megatrons_parser_and_the_planner_agree_on_the_list_form():
    from megatron.training.arguments import moe_freq_type

    from dcp_megatron.core.planning import dense_layers_of

    for text, layers, dense in (("[0]*3+[1]*58", 61, 3), ("([0]*1+[1]*1)*2", 4, 2)):
        assert dense_layers_of(SimpleNamespace(num_layers=layers, moe_layer_freq=moe_freq_type(text))) == dense


def test_the_megatron_adapter_counts_the_dense_layers_moe_layer_freq_names():
    import argparse

    from dcp_megatron.core.planning import model_shape_from_args

    args = argparse.Namespace(
        num_layers=4, hidden_size=64, num_attention_heads=4, group_query_attention=False, num_query_groups=None,
        kv_channels=16, ffn_hidden_size=256, padded_vocab_size=512, swiglu=True, tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1, expert_model_parallel_size=1, num_experts=4, moe_router_topk=2,
        moe_ffn_hidden_size=96, moe_layer_freq=[0, 0, 1, 1], transformer_impl="transformer_engine")
    shape, all_moe = model_shape_from_args(args), model_shape_from_args(argparse.Namespace(**{**vars(args),
                                                                                             "moe_layer_freq": 1}))
    assert (shape.num_dense_layers, all_moe.num_dense_layers) == (2, 0)
    assert all_moe.linear_params - shape.linear_params == 2 * (4 * 3 * 64 * 96 + 64 * 4 - 3 * 64 * 256)


@pytest.mark.parametrize("pp", [1, 2])
def test_dense_layers_keep_a_dense_layers_activations(pp):
    """The stage's layers each counted as what it is; under PP the stage of the most bytes (the pattern unknown to
    the count: d dense layers of a stage are the most or the fewest any stage may hold)."""
    from dcp_megatron.planner.costmodel.activations import layer_tensors
    from dcp_megatron.planner.costmodel import CostModel, cluster_preset
    from dcp_megatron.planner.plan import NO_RECOMPUTE, Recompute

    moe = model_preset("gpt-tiny-moe", pp=pp)
    n = moe.num_layers // pp
    per_moe = sum(layer_tensors(moe).values())
    per_dense = sum(layer_tensors(moe.dense_layer_shape()).values())
    assert per_moe != per_dense
    cluster = cluster_preset("h200", domain_size=4)

    def held(model, recompute=NO_RECOMPUTE):
        return CostModel(model, cluster).layer_bytes_per_local_token(recompute)

    for dense_layers in range(moe.num_layers + 1):
        mixed = dataclasses.replace(moe, num_dense_layers=dense_layers)
        # the stage of the most bytes: its dense layers the most or the fewest a stage of n may hold
        counts = {max(0, dense_layers - (pp - 1) * n), min(dense_layers, n)}
        expected = max(d * per_dense + (n - d) * per_moe for d in counts)
        assert held(mixed) == pytest.approx(expected, rel=1e-12), dense_layers
        low, high = sorted((n * per_dense, n * per_moe))
        assert low <= held(mixed) <= high
        # full recompute of every layer keeps their inputs alone, whatever they are
        assert held(mixed, Recompute("full", n)) == held(moe, Recompute("full", n))
