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
"""
from __future__ import annotations

import math

import numpy as np

from dcp_megatron.planner.activations import full_layer_bytes, layer_tensors, mtp_layer_bytes
from dcp_megatron.planner.memory_correction import NO_MEMORY_SCALE, MemoryScale
from dcp_megatron.planner.param_sharding import static_state_bytes
from dcp_megatron.planner.plan import NO_RECOMPUTE, SELECTIVE, Recompute
from dcp_megatron.planner.memory_spec import spec_output_bytes, spec_rope_table_bytes
from dcp_megatron.planner.relief import held_bytes_per_layer, offload_kept_bytes, stage_peak_bytes


class MemoryModel:
    """Micro-batch bytes per rank; CostModel builds it and hands out its methods."""

    def __init__(self, model, cluster, *, gpu, light: list[Recompute], full_options: list[Recompute],
                 layers_per_stage: int, profile: dict, memory_scale: MemoryScale = NO_MEMORY_SCALE) -> None:
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
        self._none_max_local = None
        self._none_max_local = self.max_local_tokens(NO_RECOMPUTE)

    def _init_layer_bytes(self, m, light, measured: dict) -> None:
        """Bytes per local token one layer keeps, per light relief and fully recomputed (the spec's count); a
        profile's measured factors (per hidden/tp unit) scale the table to its "none", and replace core-attention
        recompute's ("selective") and a recomputed layer's ("full")."""
        unit = m.hidden_size / m.tp
        tensors = layer_tensors(m)
        none = float(sum(tensors.values()))
        scale = self._scale = measured["none"] * unit / none if "none" in measured else 1.0
        self._layer_bytes = {r: held_bytes_per_layer(m, r, tensors) * scale for r in set(light) | {NO_RECOMPUTE}}
        if "selective" in measured:
            self._layer_bytes[SELECTIVE] = measured["selective"] * unit
        self._layer_bytes_none = self._layer_bytes[NO_RECOMPUTE]
        self._layer_bytes_full = measured["full"] * unit if "full" in measured else full_layer_bytes(m)

    def bytes_per_local_token(self, recompute: Recompute) -> float:
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

    def layer_bytes_per_local_token(self, recompute: Recompute) -> float:
        """Bytes per local token the stage's layers keep for backward with this relief (tools/memcheck.py)."""
        return self._held_per_layer(recompute)

    def held_bytes_per_local_token(self, recompute: Recompute) -> float:
        """Bytes per local token saved for backward during one stage's forward (no pipelining): what the
        profiler measures; the peak adds the recomputed layer's working set (`bytes_per_local_token`)."""
        return (self._held_per_layer(recompute) + self._logit_bytes_per_token) * self.memory_scale.of(str(recompute))

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

    def memory_from_tokens(self, local_tokens: float, recompute: Recompute) -> int:
        return self.static_bytes + int(math.ceil(local_tokens * self.bytes_per_local_token(recompute)))

    def max_local_tokens(self, recompute: Recompute) -> int:
        """Most local (per-rank, padded) tokens a micro-batch may hold with this recompute."""
        if recompute is NO_RECOMPUTE and self._none_max_local is not None:
            return self._none_max_local
        cached = self._max_local.get(recompute)
        if cached is None:
            room = self.cluster.mem_budget_bytes - self.static_bytes
            cached = self._max_local[recompute] = max(int(room // self.bytes_per_local_token(recompute)), 0)
        return cached

    def full_recompute_bytes(self) -> np.ndarray:
        """bytes_per_local_token of each full-recompute option, 1..n layers (read-only, cached)."""
        return self._full_bytes_per_token
