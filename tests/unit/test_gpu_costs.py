"""What the GPU path adds to the cost model: the FP8 GEMM rate, FP8 weight copies, TE's p2p ring, NCCL
communicators (planner/costmodel/gpu_costs.py); pure planner, no torch."""
from __future__ import annotations

import dataclasses

import pytest

from dcp_megatron.planner.costmodel import CostModel, cluster_preset, model_preset
from dcp_megatron.planner.costmodel.gpu_costs import (FP8_WEIGHT_COPY_BYTES, MAX_ODD_COMMUNICATORS, GpuCosts,
                                            communicators_per_rank)


def _costs(gpu: GpuCosts, *, profile=None, preset="h200", domain_size=8):
    return CostModel(model_preset("llama3-8b"), cluster_preset(preset, domain_size=domain_size), profile=profile,
                     gpu=gpu)


def test_fp8_charges_the_fp8_gemm_rate_for_linear_layers_only():
    bf16, fp8 = _costs(GpuCosts()), _costs(GpuCosts(fp8=True))
    cluster, model = bf16.cluster, bf16.model
    assert cluster.fp8_gemm_flops > cluster.gemm_flops
    lengths = [4096] * 4
    saved = bf16.microbatch_time(lengths, 1) - fp8.microbatch_time(lengths, 1)
    linear_flops = model.linear_flops_per_token * sum(lengths)
    assert saved == pytest.approx(linear_flops / cluster.gemm_flops - linear_flops / cluster.fp8_gemm_flops, rel=1e-9)
    # a measured profile's FP8 rate wins over the preset's
    measured = _costs(GpuCosts(fp8=True), profile={"fp8_gemm_flops": cluster.gemm_flops})
    assert measured.microbatch_time(lengths, 1) == pytest.approx(bf16.microbatch_time(lengths, 1), rel=1e-12)
    # a cluster without an FP8 rate (the CPU preset) charges its one GEMM rate
    assert (_costs(GpuCosts(fp8=True), preset="cpu", domain_size=2).microbatch_time([64], 1)
            == _costs(GpuCosts(), preset="cpu", domain_size=2).microbatch_time([64], 1))


def test_static_memory_counts_fp8_weight_copies_and_nccl_communicators():
    base = _costs(GpuCosts())
    model, cluster = base.model, base.cluster
    fp8 = _costs(GpuCosts(fp8=True))
    assert fp8.static_bytes - base.static_bytes == int(FP8_WEIGHT_COPY_BYTES * model.linear_params)
    comms = _costs(GpuCosts(communicators=True))
    expected = cluster.communicator_bytes * communicators_per_rank(8, 8)
    assert expected > 0 and comms.static_bytes - base.static_bytes == expected
    # the bound follows the domain: sizes 2, 4, 8 aligned + the pool's cap of other blocks
    assert communicators_per_rank(8, 8) == 3 + MAX_ODD_COMMUNICATORS
    assert communicators_per_rank(8, 4) == 2 + 1 + MAX_ODD_COMMUNICATORS   # + the whole domain of 8
    assert communicators_per_rank(6, 6) == 2 + 1 + MAX_ODD_COMMUNICATORS
    assert communicators_per_rank(2, 2) == 1 and communicators_per_rank(1, 1) == 0
    # reserved memory leaves less room for tokens
    assert comms.max_local_tokens(comms.base_recompute) < base.max_local_tokens(base.base_recompute)


def test_p2p_ring_overlaps_all_but_one_block_and_pays_a_launch_per_step():
    allgather, ring = _costs(GpuCosts()), _costs(GpuCosts(cp_ring=True))
    cluster = allgather.cluster
    # long documents: communication hides behind attention in both; only the ring's extra launches show
    long_doc = [131072]
    for c in (2, 4, 8):
        extra_launches = (c - 2) * cluster.collective_latency_s * allgather.layers_per_stage * 3
        assert ring.microbatch_time(long_doc, c) - allgather.microbatch_time(long_doc, c) == pytest.approx(
            extra_launches, rel=1e-6, abs=1e-12)
    # short documents: the ring hides less (the last block's attention overlaps nothing)
    short = [512] * 64
    assert ring.microbatch_time(short, 8) > allgather.microbatch_time(short, 8)
    # inter-node groups use the inter-node bandwidth in both
    wide = _costs(GpuCosts(cp_ring=True), domain_size=16)
    assert wide.microbatch_time(short, 16) > ring.microbatch_time(short, 8)
    assert ring.microbatch_time(long_doc, 1) == allgather.microbatch_time(long_doc, 1)   # CP 1: no ring


def test_gpu_costs_survive_refinement_and_a_cluster_checks_its_new_constants():
    ring = _costs(GpuCosts(fp8=True, cp_ring=True, communicators=True))
    assert ring.with_time_scale({(2, "none"): 1.5}).gpu == ring.gpu
    with pytest.raises(ValueError, match="fp8_gemm_flops and communicator_bytes must be >= 0"):
        dataclasses.replace(ring.cluster, communicator_bytes=-1)
