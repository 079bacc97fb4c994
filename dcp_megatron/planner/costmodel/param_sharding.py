"""What the ZeRO stage (sharded optimizer states, gradients, parameters) costs: static memory and per-micro-batch time.

The stage is `ModelShape.zero_stage` (None: the cluster's `distributed_optimizer` decides, stage 1 or 0, as
before this module). Bytes per parameter as elsewhere in the cost model: bf16 weights 2 B, fp32 gradients 4 B,
Adam's fp32 master weights and two moments 12 B; all split over tp x pp (`ModelShape.params_per_rank`), and
sharded over the DCP domain (DeepSpeed's data-parallel group, or Megatron's DP x CP group) by stage:

| stage | weights | gradients | optimizer states |
|---|---|---|---|
| 0 | full | full | full |
| 1 (distributed optimizer) | full | full | / domain |
| 2 | full | / domain | / domain |
| 3 (FSDP) | / domain | / domain | / domain |

An MoE's experts shard over domain / ep (their expert-data-parallel ranks), as with the distributed optimizer.
Stage 3 also holds the gathered weights of the layers in flight and their unreduced gradients: the largest
layer (a transformer layer or the embedding / output layer) twice, the one computed and the one prefetched
(DeepSpeed's prefetch, FSDP's `reshard_after_forward` with one layer ahead).

Per micro-batch, stage 3 all-gathers every weight of the stage in forward and again in backward, and
reduce-scatters the gradients in backward (DeepSpeed 0.19.8 reduces into the rank's partition in every
backward; docs/deepspeed.md); each moves (D - 1)/D of the stage's bf16 weights per rank over the slowest
link of the domain (inter-node when the domain spans nodes). The forward gather hides behind the forward
(1/3 of the micro-batch's compute), the backward gather and reduce-scatter behind the backward (2/3), as the
prefetch overlaps them; what does not hide is charged, plus the cluster's collective latency per layer and
collective. Stages 0-2 reduce gradients once per step (the planned step coalesces them): nothing per
micro-batch. Every rank of the domain joins every gather, so stage 3 plans run in lockstep
(`ModelShape.lockstep`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcp_megatron.planner.costmodel.cluster import ClusterSpec
from dcp_megatron.planner.costmodel.model import ModelShape

WEIGHT_BYTES = 2.0        # bf16 weights
GRAD_BYTES = 4.0          # fp32 gradients
OPTIMIZER_BYTES = 12.0    # Adam: fp32 master weights + two moments
COMM_BYTES = 2.0          # bf16 on the wire (gathers and reduce-scatters)
GATHER_PASSES_FORWARD = 1
GATHER_PASSES_BACKWARD = 2   # the weights' all-gather and the gradients' reduce-scatter


def zero_stage(model: ModelShape, cluster: ClusterSpec) -> int:
    """The run's ZeRO stage: the model's, else 1 with the distributed optimizer and 0 without."""
    if model.zero_stage is not None:
        return model.zero_stage
    return 1 if cluster.distributed_optimizer else 0


def _sharded(stage: int, shards: int) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per parameter at `stage` over `shards` ranks."""
    optimizer = OPTIMIZER_BYTES / shards if stage >= 1 else OPTIMIZER_BYTES
    grads = GRAD_BYTES / shards if stage >= 2 else GRAD_BYTES
    weights = WEIGHT_BYTES / shards if stage >= 3 else WEIGHT_BYTES
    return weights, grads, optimizer


def static_state_bytes(model: ModelShape, cluster: ClusterSpec) -> int:
    """Bytes per rank of weights, gradients and optimizer states (the stage's sharding; module docstring)."""
    stage, domain = zero_stage(model, cluster), cluster.sharding_domain_size
    split = model.tp * model.pp
    params = (model.num_params - model.expert_params) / split
    expert_params = model.expert_params / (split * model.ep)    # num_experts / ep experts per rank
    dense = sum(_sharded(stage, domain))
    expert = sum(_sharded(stage, domain // model.ep if stage >= 1 else 1))
    if stage <= 1:   # the arithmetic of the cost model before stages (plans stay bit-identical)
        opt = OPTIMIZER_BYTES / domain if stage == 1 else OPTIMIZER_BYTES
        expert_opt = opt * model.ep if stage == 1 else opt
        return int(params * (WEIGHT_BYTES + GRAD_BYTES + opt) + expert_params * (WEIGHT_BYTES + GRAD_BYTES + expert_opt))
    total = params * dense + expert_params * expert
    if stage == 3:
        total += 2 * largest_gathered_params(model) * (WEIGHT_BYTES + GRAD_BYTES)
    return int(total)


def largest_gathered_params(model: ModelShape) -> float:
    """Parameters per rank (after tp) of the largest unit stage 3 gathers at once: a layer or the embedding."""
    if model.is_moe:   # the layer's experts: num_experts / ep of them on this rank
        layer = ((model.attn_params_per_layer + model.router_params_per_layer + model.shared_expert_params) / model.tp
                 + model.num_experts * model.expert_mlp_params / (model.tp * model.ep))
    else:
        layer = (model.attn_params_per_layer + model.mlp_params_per_layer) / model.tp
    return max(layer, model.hidden_size * model.vocab_size / model.tp)


@dataclass(frozen=True, kw_only=True)
class ParamGathers:
    """Exposed seconds of stage 3's per-micro-batch weight gathers and gradient reduce-scatters (zero below 3)."""

    pass_seconds: float = 0.0   # one gather (or reduce-scatter) of the stage's weights, unhidden
    latency_s: float = 0.0      # per micro-batch: every layer's collectives' launch latency

    @classmethod
    def of(cls, model: ModelShape, cluster: ClusterSpec) -> "ParamGathers":
        if zero_stage(model, cluster) < 3 or cluster.sharding_domain_size == 1:
            return cls()
        domain = cluster.sharding_domain_size
        bw = cluster.intra_node_bw if domain <= cluster.gpus_per_node else cluster.inter_node_bw
        weights = model.params_per_rank(model.num_params)   # the stage's weights, experts / ep
        moved = COMM_BYTES * weights * (domain - 1) / domain
        layers = model.num_layers // model.pp
        collectives = layers * (GATHER_PASSES_FORWARD + GATHER_PASSES_BACKWARD)
        return cls(pass_seconds=moved / bw, latency_s=collectives * cluster.collective_latency_s)

    @property
    def active(self) -> bool:
        return self.pass_seconds > 0.0

    def seconds(self, compute_s):
        """Unhidden seconds for micro-batches of `compute_s` seconds of compute (scalar or array)."""
        if not self.active:
            return 0.0 if np.isscalar(compute_s) else np.zeros(np.shape(compute_s))
        compute = np.asarray(compute_s, dtype=np.float64)
        forward = np.maximum(GATHER_PASSES_FORWARD * self.pass_seconds - compute / 3.0, 0.0)
        backward = np.maximum(GATHER_PASSES_BACKWARD * self.pass_seconds - 2.0 * compute / 3.0, 0.0)
        exposed = forward + backward + self.latency_s
        return float(exposed) if np.ndim(exposed) == 0 else exposed
