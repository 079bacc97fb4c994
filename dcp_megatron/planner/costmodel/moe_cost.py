"""What Mixture-of-Experts layers add to the cost model's time (cost_time.py): the EP all-to-alls.

- Token dispatch and combine (Megatron's alltoall token dispatcher): per MoE layer and micro-batch, forward
  dispatch + combine and backward the two gradients' all-to-alls, MOE_A2A_PASSES = 4. Each rank sends every
  one of its tokens' top-k copies to the expert's rank; with uniform routing (ep - 1)/ep of them leave it:
      bytes per local token, layer and pass = (1/tp) · hidden · topk · 2 B · (ep - 1)/ep
  (1/tp: with sequence parallelism each TP rank dispatches its 1/tp of the micro-batch's rows). The bandwidth
  is the EP group's: EP groups are ep consecutive ranks of the domain (Megatron's expert rank order keeps
  tensor parallelism inside and EP next), so intra-node when ep fits a node's domain ranks, else inter-node,
  as cluster.same_node prices a CP group. Not overlapped with compute (Megatron overlaps them only with
  --overlap-moe-expert-parallel-comm); each all-to-all also pays the cluster's collective latency.
- Recompute: full recompute of k layers replays their forward, so 2 more passes per recomputed layer;
  selective recompute reruns core attention only (no all-to-all).
- Activations: an MoE layer's tensors (topk copies of each token at the experts' width) are counted with the
  dense ones in activations.py.
Weights and FLOPs of the experts are the model's (model.ModelShape: params_per_rank, linear_flops_per_token).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcp_megatron.planner.costmodel.cluster import ClusterSpec
from dcp_megatron.planner.costmodel.model import ModelShape

MOE_A2A_PASSES = 4            # dispatch + combine forward, their gradients backward
RECOMPUTE_A2A_PASSES = 2      # a recomputed layer replays its forward dispatch + combine
BYTES_PER_VALUE = 2           # bf16 hidden states


@dataclass(frozen=True, kw_only=True)
class MoeComm:
    """Seconds of one pipeline stage's EP all-to-alls for a micro-batch (zero for dense models or EP 1)."""

    layers_per_stage: int
    seconds_per_local_token: float = 0.0   # per layer and pass
    latency_s: float = 0.0                 # per all-to-all (one layer, one pass)

    def __post_init__(self) -> None:
        if self.layers_per_stage <= 0 or self.seconds_per_local_token < 0 or self.latency_s < 0:
            raise ValueError(f"MoeComm needs layers_per_stage > 0 and non-negative costs, got {self!r}")

    @classmethod
    def of(cls, model: ModelShape, cluster: ClusterSpec) -> "MoeComm":
        layers = model.num_layers // model.pp
        if not model.is_moe or model.ep == 1:
            return cls(layers_per_stage=layers)
        bytes_per_local_token = (model.hidden_size / model.tp * model.moe_topk * BYTES_PER_VALUE
                                 * (model.ep - 1) / model.ep)
        bw = cluster.intra_node_bw if cluster.same_node(0, model.ep) else cluster.inter_node_bw
        return cls(layers_per_stage=layers, seconds_per_local_token=bytes_per_local_token / bw,
                   latency_s=cluster.collective_latency_s)

    def layer_passes(self, full_layers):
        """All-to-alls per micro-batch (layers x passes) with `full_layers` recomputed layers (scalar or array)."""
        return self.layers_per_stage * MOE_A2A_PASSES + RECOMPUTE_A2A_PASSES * np.asarray(full_layers, dtype=np.float64)

    def seconds(self, local_tokens, full_layers=0):
        """Seconds of a micro-batch's all-to-alls (local tokens and full_layers scalars or arrays; 0 tokens: 0)."""
        if self.seconds_per_local_token == 0.0 and self.latency_s == 0.0:
            return 0.0
        local = np.asarray(local_tokens, dtype=np.float64)
        t = self.layer_passes(full_layers) * (self.seconds_per_local_token * local + self.latency_s)
        return np.where(local > 0, t, 0.0) if np.ndim(t) else (float(t) if local > 0 else 0.0)
