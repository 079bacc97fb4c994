"""The memory-relief menu of one micro-batch and what each relief costs and frees (cost.py scores them).

A relief is a `Recompute` (planner/plan.py): none; a set of megatron-core `recompute_modules` (kind "selective");
full recompute of k layers; or, with kind none or selective, a set of `offload_modules` (fine-grained
activation offloading, GPU only: the cluster needs a host link). megatron-core 0.19.2 combines them as its
TransformerConfig allows: selective and full are one granularity or the other; `attn_proj` offload needs
`core_attn` offload; no offload inside a recomputed MoE layer; `mlp` recompute applies to dense layers only,
`moe_act` / `moe` to MoE layers. Modules that free nothing for the model and spec (activations.py: `layernorm`
under TE for a dense model) are left out, and so is any relief another one dominates (a subset of its modules
and offloads freeing at least as much).

Menu names (`--dcp-recompute`, `CostModel(allowed_recompute=...)`): "none", "full", each recompute module,
"offload" (every offload set), and "selective", the old name for `core_attn` recompute. `menu_names` checks a
tuple of them.

Cost per micro-batch (`ReliefCosts.extra_seconds`): a recomputed module reruns its forward FLOPs (x the
cluster's recompute_cost_factor): core attention a third of the attention seconds, the MLP / experts their
share of the linear seconds, norms and activations ~0 (elementwise); `moe` also replays the layers' forward
all-to-alls. Offload: the bytes moved cross the host link in forward (device to host) and back in backward,
overlapped with that pass's compute; only the excess shows.
"""
from __future__ import annotations

from itertools import combinations

import numpy as np

from dcp_megatron.planner.costmodel.activations import (freed_by_offload, freed_by_recompute, kept_by_recompute,
                                                        layer_tensors, moved_by_offload)
from dcp_megatron.planner.costmodel.memory_spec import spec_gradient_bytes
from dcp_megatron.planner.plan import NO_RECOMPUTE, RECOMPUTE_MODULE_NAMES, SELECTIVE, Recompute

MENU_NAMES = ("none", "selective", "full") + tuple(m for m in RECOMPUTE_MODULE_NAMES if m != "shared_experts") \
    + ("offload",)
ATTENTION_OFFLOADS = (frozenset(), frozenset({"core_attn"}), frozenset({"core_attn", "attn_proj"}))
MOE_OFFLOADS = (frozenset(), frozenset({"expert_fc1"}), frozenset({"expert_fc1", "moe_act"}))
# Layers of a stage whose offloaded tensors stay on the GPU: megatron-core 0.19.2 keeps the last group of each
# offload name (`_offload_margin`, fine_grained_activation_offload.py: reloading it would stall backward's start)
# and holds one more layer's group while it is copied out, or reloaded ahead of its backward.
OFFLOAD_KEPT_LAYERS = 2


def menu_names(names) -> tuple[str, ...]:
    """The menu names in MENU_NAMES order; ValueError for a string, an empty set or unknown names."""
    if isinstance(names, str):
        raise ValueError(f"allowed_recompute must be a collection of names such as ('none', 'full'), "
                         f"not the string {names!r}")
    names = tuple(names)
    bad = [n for n in names if n not in MENU_NAMES]
    if bad:
        raise ValueError(f"allowed_recompute: unknown recompute kind(s) {bad}; choose from {list(MENU_NAMES)}")
    if not names:
        raise ValueError(f"allowed_recompute must name at least one of {list(MENU_NAMES)}, got an empty set")
    return tuple(n for n in MENU_NAMES if n in names)


def allows(names: tuple[str, ...], recompute: Recompute) -> bool:
    """Whether a relief is on the menu `names` (validate checks plans against it)."""
    if recompute.kind == "full":
        return "full" in names
    if recompute.offload and "offload" not in names:
        return False
    if not recompute.modules:
        return "none" in names or bool(recompute.offload)
    mods = set(recompute.modules)
    if mods == {"core_attn"} and "selective" in names:
        return True
    return all(m in names or (m == "core_attn" and "selective" in names) for m in mods)


def light_reliefs(model, names: tuple[str, ...], *, can_offload: bool) -> list[Recompute]:
    """The menu's reliefs without full recompute, undominated, most bytes kept first (none first if allowed)."""
    tensors = layer_tensors(model)
    allowed_mods = [m for m in RECOMPUTE_MODULE_NAMES
                    if (m in names or (m == "core_attn" and "selective" in names)) and freed_by_recompute(model, m)]
    offloads = [a | b for a in ATTENTION_OFFLOADS for b in (MOE_OFFLOADS if model.is_moe else (frozenset(),))]
    if not (can_offload and "offload" in names):
        offloads = [frozenset()]
    options = []
    for r in range(len(allowed_mods) + 1):
        for mods in combinations(allowed_mods, r):
            mods = frozenset(mods)
            if {"moe", "moe_act"} <= mods:
                continue                              # moe recomputes the activation already
            for off in offloads:
                if off & mods or ("moe" in mods and off & {"expert_fc1", "moe_act"}):
                    continue                          # megatron-core refuses offload inside a recomputed module
                if not mods and not off and "none" not in names:
                    continue
                if off and not mods and "none" not in names:
                    continue                          # offload alone keeps every module: needs "none" allowed
                options.append(Recompute("selective" if mods else "none", modules=mods, offload=off))
    held = {r: held_bytes_per_layer(model, r, tensors) for r in options}
    keep = [b for b in options if not any(
        a != b and a.modules <= b.modules and a.offload <= b.offload and held[a] <= held[b] for a in options)]
    # the module singletons for none and core attention: callers test `is NO_RECOMPUTE`
    keep = [NO_RECOMPUTE if r == NO_RECOMPUTE else SELECTIVE if r == SELECTIVE else r for r in keep]
    return sorted(keep, key=lambda r: (-held[r], len(r.modules) + len(r.offload)))


def held_bytes_per_layer(model, recompute: Recompute, tensors: dict | None = None) -> float:
    """Bytes per local token one layer keeps with a light relief (not full)."""
    tensors = layer_tensors(model) if tensors is None else tensors
    freed, kept = set(), {}
    for m in recompute.modules:
        freed |= freed_by_recompute(model, m)
        kept.update(kept_by_recompute(model, m))
    for m in recompute.offload:
        freed |= freed_by_offload(model, m)
    return float(sum(v for k, v in tensors.items() if k not in freed) + sum(kept.values()))


def stage_peak_bytes(model, recompute: Recompute, *, held: float, none_bytes: float, relief_bytes: float,
                     full_bytes: float, output_bytes: float, layers: int) -> float:
    """Peak bytes per local token of one stage's micro-batch (no pipelining), `held` its layers' saved bytes and
    `relief_bytes` one layer's with the relief's recompute modules (no offload; `none_bytes`' units): the
    loss's (everything held and the output layer's `output_bytes`) or a layer's backward, whichever is higher. The
    last layer's backward holds everything and what its recomputed modules bring back, with the gradients
    (memory_spec.py); block recompute reruns the first k layers last, when only their k inputs are left, one of
    them rerun whole beside its input."""
    mlp_grad, norm_grad = spec_gradient_bytes(model, model.activation_spec)
    if recompute.kind == "full":
        k = recompute.full_layers
        last = held + max(mlp_grad, norm_grad) if k < layers else 0.0
        return max(held + output_bytes, last, k * full_bytes + none_bytes + max(mlp_grad, norm_grad))
    return held + max(output_bytes, none_bytes - relief_bytes + mlp_grad, norm_grad)


def offload_kept_bytes(model, recompute: Recompute, layers: int) -> float:
    """Bytes per local token a stage's offloads leave on the GPU after all (OFFLOAD_KEPT_LAYERS layers' worth)."""
    if not recompute.offload:
        return 0.0
    kept_on_gpu = Recompute(recompute.kind, modules=recompute.modules)
    return min(layers, OFFLOAD_KEPT_LAYERS) * (held_bytes_per_layer(model, kept_on_gpu)
                                               - held_bytes_per_layer(model, recompute))


def offloaded_bytes_per_layer(model, recompute: Recompute, tensors: dict | None = None) -> float:
    tensors = layer_tensors(model) if tensors is None else tensors
    """Bytes per local token one layer's offloads copy to the host (and back for backward)."""
    moved = set()
    for m in recompute.offload:
        moved |= moved_by_offload(model, m)
    return float(sum(tensors[k] for k in moved))


class ReliefCosts:
    """Added seconds of a light relief for a micro-batch, from its sums (scalars or arrays)."""

    def __init__(self, model, cluster, moe, layers_per_stage: int) -> None:
        self.model, self.cluster, self.moe, self.layers = model, cluster, moe, layers_per_stage
        linear = model.active_linear_params
        self.mlp_share = 0.0 if model.is_moe else model.num_layers * model.expert_mlp_params / linear
        self.expert_share = ((model.num_layers - model.num_dense_layers) * (model.moe_topk * model.expert_mlp_params + model.shared_expert_params)
                             / linear if model.is_moe else 0.0)
        self._offloaded: dict[Recompute, float] = {}

    def extra_seconds(self, local_tokens, compute_s, attn_s, recompute: Recompute):
        f = self.cluster.recompute_cost_factor
        linear = np.maximum(np.asarray(compute_s) - np.asarray(attn_s), 0.0)
        extra = 0.0
        if "core_attn" in recompute.modules:
            extra = extra + np.asarray(attn_s) / 3.0 * f
        if "mlp" in recompute.modules:
            extra = extra + linear * self.mlp_share / 3.0 * f
        if "moe" in recompute.modules:
            extra = extra + linear * self.expert_share / 3.0 * f + (
                self.moe.seconds(local_tokens, self.layers) - self.moe.seconds(local_tokens, 0))
        if recompute.offload and self.cluster.host_link_bw > 0:
            extra = extra + self._offload_exposed(local_tokens, compute_s, recompute, 0.0, 0.0)
        return extra

    def _offload_exposed(self, local_tokens, compute_s, recompute: Recompute, nic_forward_s, nic_backward_s):
        """Seconds the host link adds beyond what the passes' compute hides: the offload copies one way in the
        forward and back in the backward, beside `nic_*_s` seconds of other traffic on the same link."""
        per_token = self._offloaded.get(recompute)
        if per_token is None:
            per_token = self._offloaded[recompute] = offloaded_bytes_per_layer(self.model, recompute) * self.layers
        move = np.asarray(local_tokens) * per_token / self.cluster.host_link_bw
        total = np.asarray(compute_s)
        return (np.maximum(move + nic_forward_s - total / 3.0, 0.0)
                + np.maximum(move + nic_backward_s - 2.0 * total / 3.0, 0.0))

    def nic_contention_seconds(self, local_tokens, compute_s, recompute: Recompute, nic_bytes, passes):
        """What offload adds when a CP group spans nodes: the NIC reaches the GPU through the same PCIe link as the
        host copies (GPUDirect RDMA on an H200 node), so the `nic_bytes` a micro-batch's inter-node CP traffic
        moves (one of `passes` in the forward, the rest in the backward) leave the copies less of the link. The
        CP traffic's own time is charged by the CP model; this is only the offload's extra exposure."""
        if not recompute.offload or self.cluster.host_link_bw <= 0:
            return 0.0
        nic_s = np.asarray(nic_bytes, dtype=np.float64) / self.cluster.host_link_bw
        forward, backward = nic_s / passes, nic_s * (passes - 1) / passes
        return (self._offload_exposed(local_tokens, compute_s, recompute, forward, backward)
                - self._offload_exposed(0.0, compute_s, recompute, forward, backward))
