"""Peak bytes per rank of one micro-batch (docs/cost_model.md).

memory = static state (bf16 weights 2 B + fp32 grads 4 B per parameter, Adam fp32 master + two moments 12 B
         sharded over the domain with the distributed optimizer; all /(tp·pp), an MoE's experts /(tp·pp·ep);
         ZeRO-2 / ZeRO-3 shard gradients / weights too: param_sharding.py; FP8 copies and communicator
         buffers: gpu_costs.py)
       + per local token: what the stage's layers keep for backward with the micro-batch's relief (the model's
         ActivationSpec, memory_spec.py; relief.py), at the higher of the loss's peak (the output layer's logits
         and their fp32 upcast, vocab/tp per token) and a layer's backward (its gradients beside what it
         recomputes); MTP layers add their layer and the output layer once more each, on the last stage;
         with PP stage 0 holds pp micro-batches in flight (1F1B).

Our CPU attention (memory_spec.py, attention "cpu") keeps per-group tensors, so its count depends on the
micro-batch's CP size: each method takes the `cp_size` where the caller knows it; without one it answers for the
size, CP 1 or the largest allowed, that counts more (a bound that holds whatever group a packer fills). The GPU
specs' count is the same for every group.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from dcp_megatron.planner.costmodel.activations import full_layer_bytes, layer_tensors, mtp_layer_bytes
from dcp_megatron.planner.costmodel.memory_correction import NO_MEMORY_SCALE, MemoryScale
from dcp_megatron.planner.costmodel.param_sharding import static_state_bytes
from dcp_megatron.planner.plan import NO_RECOMPUTE, SELECTIVE, Recompute
from dcp_megatron.planner.costmodel.memory_spec import spec_output_bytes, spec_rope_table_bytes
from dcp_megatron.planner.costmodel.relief import held_bytes_per_layer, offload_kept_bytes, stage_peak_bytes


class MemoryModel:
    """Micro-batch bytes per rank; CostModel builds it and hands out its methods."""

    def __init__(self, model, cluster, *, gpu, light: list[Recompute], full_options: list[Recompute],
                 layers_per_stage: int, profile: dict, cp_size: int | None = None, ulysses: bool = False,
                 memory_scale: MemoryScale = NO_MEMORY_SCALE) -> None:
        spec = model.activation_spec
        self._per_cp: dict[int, MemoryModel] | None = None    # the count per CP size, where it depends on it
        if cp_size is None and spec is not None and spec.attention == "cpu":
            parts = dict(gpu=gpu, light=light, full_options=full_options, layers_per_stage=layers_per_stage,
                         profile=profile, memory_scale=memory_scale)
            self._per_cp = {}
            # Ulysses (read, not measured) attends the whole sequence on c times the rows with heads / c, as CP 1
            # does: a group that may run it is counted at least as CP 1
            self._count_for = lambda size: max(
                (MemoryModel(model, cluster, cp_size=c, **parts) for c in ({1, size} if ulysses else {size})),
                key=lambda count: count._none_bytes_per_token)
            # linear in c beyond CP 1: the bound is at one end
            cp_size = max((1, cluster.cp_size_limit), key=lambda size: self.for_cp_size(size)._none_bytes_per_token)
        if cp_size is not None:
            model = dataclasses.replace(model, activations=dataclasses.replace(spec, cp_size=cp_size))
        self.model, self.cluster = model, cluster
        # measured corrections (memory_correction.py): activation bytes per local token x factor per relief
        self.memory_scale = memory_scale
        self.layers_per_stage = layers_per_stage
        self._max_local: dict[Recompute, int] = {}    # memoised per recompute policy
        self._bytes_per_token: dict[Recompute, float] = {}
        self._init_layer_bytes(model, light, profile.get("activation_bytes_per_hidden", {}))
        # a measured "full" factor holds the RoPE table its checkpoints keep
        measured = profile.get("activation_bytes_per_hidden", {})
        self._rope_table_bytes = 0.0 if "full" in measured else spec_rope_table_bytes(model)
        # the output layer (memory_spec.py) keeps per-token tensors beside its per-vocab ones; a profile's measured
        # factor holds everything outside the layers (profile_fit.py), so it replaces both
        per_vocab, per_token = spec_output_bytes(model, model.activation_spec)
        if "output_bytes_per_vocab" in profile:
            per_vocab, per_token = profile["output_bytes_per_vocab"], 0.0
        output = per_vocab * model.vocab_size / model.tp + per_token
        # MTP (last stage): its layers, and the output layer and loss once more each, alive at the main loss's peak
        self._logit_bytes_per_token = ((1 + model.mtp_num_layers) * output
                                       + model.mtp_num_layers * mtp_layer_bytes(model))
        # weights, gradients, optimizer states as the ZeRO stage shards them
        self.static_bytes = static_state_bytes(model, cluster) + gpu.static_bytes(model, cluster)
        self._none_bytes_per_token = self._bytes_per_local_token(NO_RECOMPUTE)
        self._full_bytes_per_token = np.array([self.bytes_per_local_token(r) for r in full_options])
        # whether those bytes fall (or stay) as k grows: not always (relief_choice.py)
        self._full_bytes_fall = bool((np.diff(self._full_bytes_per_token) <= 0).all())
        self._none_max_local = None
        self._none_max_local = self.max_local_tokens(NO_RECOMPUTE)

    def _init_layer_bytes(self, m, light, measured: dict) -> None:
        """Bytes per local token one layer keeps, per light relief and fully recomputed (the spec's count); a
        profile's measured factors (per hidden/tp unit) scale the table to its "none", and replace core-attention
        recompute's ("selective") and a recomputed layer's ("full")."""
        unit = m.hidden_size / m.tp
        tensors = layer_tensors(m)
        held = lambda r: held_bytes_per_layer(m, r, tensors)
        if m.num_dense_layers:      # --moe-layer-freq's dense layers: the stage's mix, per layer
            held = self._mixed_layers(m, held)
        none = held(NO_RECOMPUTE)
        scale = self._scale = measured["none"] * unit / none if "none" in measured else 1.0
        self._layer_bytes = {r: held(r) * scale for r in set(light) | {NO_RECOMPUTE}}
        if "selective" in measured:
            self._layer_bytes[SELECTIVE] = measured["selective"] * unit
        self._layer_bytes_none = self._layer_bytes[NO_RECOMPUTE]
        self._layer_bytes_full = measured["full"] * unit if "full" in measured else full_layer_bytes(m)

    def _mixed_layers(self, m, moe_held):
        """Bytes per layer (the mean over the stage) a relief keeps in the stage with the most of a model with dense
        layers: d dense ones of the stage's n, d the most or the fewest any stage may hold (pp stages of n layers,
        the pattern unknown here), whichever keeps more. The one-layer terms of the peak (a layer's backward,
        relief.stage_peak_bytes) take this mean and an MoE layer's gradients."""
        dense = m.dense_layer_shape()
        dense_tensors = layer_tensors(dense)
        n, total = self.layers_per_stage, m.num_dense_layers
        choices = {max(0, total - (m.pp - 1) * n), min(total, n)}
        mixed = lambda d: lambda r: (d * held_bytes_per_layer(dense, r, dense_tensors) + (n - d) * moe_held(r)) / n
        return max((mixed(d) for d in sorted(choices)), key=lambda held: held(NO_RECOMPUTE))

    def for_cp_size(self, cp_size: int | None) -> "MemoryModel":
        """The count for micro-batches of a CP group of `cp_size` (None: the bound); itself where it is the same."""
        if cp_size is None or self._per_cp is None:
            return self
        count = self._per_cp.get(cp_size)
        if count is None:
            count = self._per_cp[cp_size] = self._count_for(cp_size)
        return count

    def bytes_per_local_token(self, recompute: Recompute, cp_size: int | None = None) -> float:
        if cp_size is not None and self._per_cp is not None:
            return self.for_cp_size(cp_size).bytes_per_local_token(recompute)
        if recompute is NO_RECOMPUTE:                  # the common case, without hashing
            return self._none_bytes_per_token
        cached = self._bytes_per_token.get(recompute)
        if cached is None:
            cached = self._bytes_per_token[recompute] = self._bytes_per_local_token(recompute)
        return cached

    def _held_per_layer(self, recompute: Recompute) -> float:
        """Bytes per local token the stage's layers hold for backward with this relief."""
        n = self.layers_per_stage
        if recompute.kind == "full":
            k = recompute.full_layers
            return (n - k) * self._layer_bytes_none + k * self._layer_bytes_full + self._rope_table_bytes
        held = self._layer_bytes.get(recompute)
        if held is None:     # a relief off this model's menu (validate refuses it): counted as none
            held = self._layer_bytes_none
        return n * held + offload_kept_bytes(self.model, recompute, n)

    def layer_bytes_per_local_token(self, recompute: Recompute, cp_size: int | None = None) -> float:
        """Bytes per local token the stage's layers keep for backward with this relief (tools/memcheck.py)."""
        return self.for_cp_size(cp_size)._held_per_layer(recompute)

    def held_bytes_per_local_token(self, recompute: Recompute, cp_size: int | None = None) -> float:
        """Bytes per local token saved for backward during one stage's forward (no pipelining): what the
        profiler measures; the peak adds the recomputed layer's working set (`bytes_per_local_token`)."""
        count = self.for_cp_size(cp_size)
        return (count._held_per_layer(recompute) + count._logit_bytes_per_token) * self.memory_scale.of(str(recompute))

    def _bytes_per_local_token(self, recompute: Recompute) -> float:
        return self._counted_bytes_per_local_token(recompute) * self.memory_scale.of(str(recompute))

    def _counted_bytes_per_local_token(self, recompute: Recompute) -> float:
        """The loss's peak or a layer's backward, whichever is higher; with PP, pp micro-batches in flight."""
        held = self._held_per_layer(recompute)
        relief = self._layer_bytes_none       # unused for full recompute
        if recompute.kind != "full":           # the relief's modules: its offloads come back for backward
            modules_only = Recompute(recompute.kind, modules=recompute.modules)
            relief = self._layer_bytes.get(modules_only)
            if relief is None:
                relief = held_bytes_per_layer(self.model, modules_only) * self._scale
        peak = stage_peak_bytes(self.model, recompute, held=held, none_bytes=self._layer_bytes_none,
                                relief_bytes=relief, full_bytes=self._layer_bytes_full,
                                output_bytes=self._logit_bytes_per_token, layers=self.layers_per_stage)
        return max(self.model.pp * (peak - self._logit_bytes_per_token), peak)

    def memory_from_tokens(self, local_tokens: float, recompute: Recompute, cp_size: int | None = None) -> int:
        return self.static_bytes + int(math.ceil(local_tokens * self.bytes_per_local_token(recompute, cp_size)))

    def max_local_tokens(self, recompute: Recompute, cp_size: int | None = None) -> int:
        """Most local (per-rank, padded) tokens a micro-batch may hold with this recompute."""
        if cp_size is not None and self._per_cp is not None:
            return self.for_cp_size(cp_size).max_local_tokens(recompute)
        if recompute is NO_RECOMPUTE and self._none_max_local is not None:
            return self._none_max_local
        cached = self._max_local.get(recompute)
        if cached is None:
            room = self.cluster.mem_budget_bytes - self.static_bytes
            cached = self._max_local[recompute] = max(int(room // self.bytes_per_local_token(recompute)), 0)
        return cached

    def full_recompute_bytes(self, cp_size: int | None = None) -> np.ndarray:
        """bytes_per_local_token of each full-recompute option, 1..n layers (read-only, cached)."""
        return self.for_cp_size(cp_size)._full_bytes_per_token

    def full_bytes_fall(self, cp_size: int | None = None) -> bool:
        """Whether `full_recompute_bytes` never rises with k (relief_choice.py: it may)."""
        return self.for_cp_size(cp_size)._full_bytes_fall
