"""Cost model: time and per-rank memory of one micro-batch, and the relief it runs (docs/cost_model.md).

A micro-batch is a list of documents packed THD and run by a CP group of c ranks in lock-step; each document is
padded to a multiple of 2c (planner/padding.py), so padding is paid. `CostModel` is the one object every policy scores
with; it builds three parts and hands out their methods as its own:
- cost_time.py      `TimeModel`: seconds (compute, relief, MoE all-to-alls, ZeRO-3 gathers, exposed CP comm);
- cost_memory.py    `MemoryModel`: bytes per rank (static state, activations kept per local token, logits);
- relief_choice.py  `ReliefChoice`: the run's relief options and the fastest one that fits.
Here: its inputs checked, a profile applied, and the same questions asked of a list of document lengths.

Profile JSON (`load_profile`) overrides the cluster constants; all keys optional:
    {"gemm_flops": float FLOP/s,
     "attn_rate_points": [[length, FLOP/s], ...]    sorted by length,
     "intra_node_bw": bytes/s, "inter_node_bw": bytes/s,
     "microbatch_overhead_s": s, "collective_latency_s": s, "document_overhead_s": s,
     "recompute_cost_factor": x (cost of a recomputed forward / its modelled FLOP share),
     "fp8_gemm_flops": float FLOP/s (the linear layers' rate under FP8),
     "attention_times": [[length, cp_size, seconds], ...],
     "activation_bytes_per_hidden": {"none": x, "selective": x, "full": x},
     "output_bytes_per_vocab": x,
     "meta": {...}}                                  free-form, ignored
`attention_times` are measured forward+backward causal-attention seconds per document per
rank for one pipeline stage of this model at its tp; when given they replace the FLOP/rate
estimate: interpolated log-log in length among the rows of the largest listed cp size <= c,
scaled by cp_row/c, extrapolated as L² beyond the table. `activation_bytes_per_hidden` (measured
bytes saved for backward per local token per layer per hidden/tp unit, by recompute kind; "full" is a
recomputed layer's) scales activations.py's counted table to its "none" and replaces its "selective" and
"full" (cost_memory.py), `output_bytes_per_vocab` (per local token per vocab/tp unit, outside the layers) the
output layer's 6.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from dcp_megatron.planner.costmodel.cluster import ClusterSpec
from dcp_megatron.planner.costmodel.cost_memory import MemoryModel
from dcp_megatron.planner.costmodel.cost_profile import (PROFILE_SCALARS, RECOMPUTE_KINDS, check_cp_attention,
                                                         check_profile)
from dcp_megatron.planner.costmodel.cost_time import TimeModel
from dcp_megatron.planner.costmodel.gpu_costs import GpuCosts
from dcp_megatron.planner.costmodel.memory_correction import NO_MEMORY_SCALE, MemoryScale
from dcp_megatron.planner.costmodel.model import ModelShape
from dcp_megatron.planner.costmodel.moe_cost import MoeComm
from dcp_megatron.planner.padding import local_tokens, padded_length
from dcp_megatron.planner.costmodel.param_sharding import ParamGathers
from dcp_megatron.planner.plan import NO_RECOMPUTE, Recompute
from dcp_megatron.planner.costmodel.relief import ReliefCosts, allows, light_reliefs, menu_names
from dcp_megatron.planner.costmodel.relief_choice import ReliefChoice

# the parts' methods the cost model answers with (bound once: the planners call them in their hot loops)
TIME_METHODS = ("doc_terms", "ideal_doc_seconds", "ideal_rank_seconds", "recompute_extra", "full_recompute_seconds",
                "time_from_sums", "times_from_sums")
MEMORY_METHODS = ("bytes_per_local_token", "held_bytes_per_local_token", "layer_bytes_per_local_token",
                  "memory_from_tokens", "max_local_tokens", "full_recompute_bytes")
RELIEF_METHODS = ("recompute_options", "full_recompute_options", "choose_recompute", "best_recompute_from_sums",
                  "best_reliefs_from_sums", "fitting_reliefs", "doc_alone_seconds")


class CostModel:
    """Scores micro-batches; the same instance scores every policy."""

    def __init__(self, model: ModelShape, cluster: ClusterSpec, *, profile: dict | None = None,
                 allowed_recompute=RECOMPUTE_KINDS, time_scale: dict | None = None,
                 cp_attention: tuple[str, ...] = ("allgather",), gpu: GpuCosts = GpuCosts(),
                 memory_scale: MemoryScale = NO_MEMORY_SCALE) -> None:
        if not isinstance(model, ModelShape):
            raise ValueError(f"CostModel needs a ModelShape, got {type(model).__name__}")
        if not isinstance(cluster, ClusterSpec):
            raise ValueError(f"CostModel needs a ClusterSpec, got {type(cluster).__name__}")
        # the recompute kinds every choice below is restricted to (validate checks plans against it)
        self.allowed_recompute: tuple[str, ...] = menu_names(allowed_recompute)
        # the CP attention flavours plans may use: "allgather" (K/V all-gather, overlapped) and "ulysses"
        self.cp_attention: tuple[str, ...] = check_cp_attention(cp_attention)
        self.prefer_ulysses = tuple(cp_attention) == ("ulysses",) or cp_attention == "ulysses"
        self._init_args = (model, cluster, profile)
        self.gpu = gpu   # FP8 GEMMs, TE's p2p ring, NCCL communicators (gpu_costs.py)
        # Measured corrections (planner/costmodel/refine.py): micro-batch seconds x factor per (cp size, relief name).
        self.time_scale: dict[tuple[int, str], float] = dict(time_scale or {})
        bad = {k: v for k, v in self.time_scale.items() if not (math.isfinite(v) and v > 0)}
        if bad:
            raise ValueError(f"time_scale factors must be positive and finite, got {bad}")
        # Measured memory (costmodel/memory_correction.py): activation bytes per local token x factor per relief name.
        if not isinstance(memory_scale, MemoryScale):
            raise ValueError(f"memory_scale must be a MemoryScale, got {type(memory_scale).__name__}")
        self.memory_scale = memory_scale
        self._memo: dict = {}                          # see `memoised`
        if profile is not None:
            check_profile(profile)
            changes = {k: profile[k] for k in PROFILE_SCALARS if k in profile}
            if "attn_rate_points" in profile:
                changes["attn_rate_points"] = tuple(sorted((int(L), float(r)) for L, r in profile["attn_rate_points"]))
            cluster = dataclasses.replace(cluster, **changes)
        self.model = model
        self.cluster = cluster
        m = model
        if cluster.domain_size % m.ep:
            raise ValueError(f"ep={m.ep} does not divide the domain of {cluster.domain_size} ranks "
                             f"(EP groups are carved out of the DP x CP ranks)")
        self.moe = MoeComm.of(m, cluster)    # EP all-to-alls (zero for dense models and EP 1)
        self.layers_per_stage = m.num_layers // m.pp
        self._relief_costs = ReliefCosts(m, cluster, self.moe, self.layers_per_stage)
        # stage 3's weight gathers (param_sharding.py)
        self.param_gathers = ParamGathers.of(m, cluster)
        light = light_reliefs(m, self.allowed_recompute, can_offload=cluster.host_link_bw > 0)
        full = [Recompute("full", k) for k in range(1, self.layers_per_stage + 1)]
        self.time = TimeModel(m, cluster, gpu=gpu, moe=self.moe, param_gathers=self.param_gathers,
                              relief_costs=self._relief_costs, layers_per_stage=self.layers_per_stage,
                              cp_attention=self.cp_attention, prefer_ulysses=self.prefer_ulysses,
                              time_scale=self.time_scale, attention_times=(profile or {}).get("attention_times", ()))
        self.memory = MemoryModel(m, cluster, gpu=gpu, light=light, full_options=full,
                                  layers_per_stage=self.layers_per_stage, profile=profile or {},
                                  memory_scale=memory_scale, ulysses="ulysses" in self.cp_attention)
        self.relief = ReliefChoice(self.time, self.memory, light=light, full_options=full,
                                   allowed_recompute=self.allowed_recompute)
        self.static_bytes = self.memory.static_bytes
        self.base_recompute = self.relief.base_recompute
        self.strongest_recompute = self.relief.strongest_recompute
        for part, names in ((self.time, TIME_METHODS), (self.memory, MEMORY_METHODS), (self.relief, RELIEF_METHODS)):
            for name in names:
                setattr(self, name, getattr(part, name))
        # the parts' internals unit tests read by these names
        self._layer_bytes = self.memory._layer_bytes
        self._linear_s_per_token = self.time._linear_s_per_token
        self._fewest_full_layers = self.relief.fewest_full_layers

    def allows(self, recompute: Recompute) -> bool:
        """Whether plans may use this relief (the menu `allowed_recompute` names; validate checks plans)."""
        return allows(self.allowed_recompute, recompute) and (recompute.kind == "full"
                                                              or recompute in self.memory._layer_bytes)

    def with_time_scale(self, time_scale: dict) -> "CostModel":
        """The same cost model with micro-batch times scaled per (cp size, relief name: str(Recompute))."""
        return self._with(time_scale=time_scale, memory_scale=self.memory_scale)

    def with_memory_scale(self, memory_scale: MemoryScale) -> "CostModel":
        """The same cost model with activation bytes scaled per relief name (memory_correction.py)."""
        return self._with(time_scale=self.time_scale, memory_scale=memory_scale)

    def with_cluster(self, **changes) -> "CostModel":
        """The same cost model on a cluster with these fields changed (e.g. mem_bytes_per_gpu, domain_size)."""
        return self._with(time_scale=self.time_scale, memory_scale=self.memory_scale, cluster_changes=changes)

    def _with(self, *, time_scale: dict, memory_scale: MemoryScale, cluster_changes: dict | None = None) -> "CostModel":
        model, cluster, profile = self._init_args
        cluster = dataclasses.replace(cluster, **cluster_changes) if cluster_changes else cluster
        return CostModel(model, cluster, profile=profile, allowed_recompute=self.allowed_recompute,
                         time_scale=time_scale, gpu=self.gpu, memory_scale=memory_scale,
                         cp_attention=("ulysses",) if self.prefer_ulysses else self.cp_attention)

    def memoised(self, key, make):
        """make() once per key for this cost model: run-wide values a policy derives from the
        cost model alone (e.g. the static layout of a length cap), not per batch."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    # ---- a micro-batch given as its documents' lengths ------------------------------------
    @staticmethod
    def _checked_lengths(lengths: Sequence[int], cp_size: int) -> np.ndarray | None:
        if not isinstance(cp_size, int) or cp_size <= 0:
            raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
        if len(lengths) == 0:
            return None
        arr = np.asarray(lengths, dtype=np.int64)
        if arr.min() <= 0:
            raise ValueError(f"document lengths must be positive, got {int(arr.min())}")
        return arr

    def _sums(self, lengths: Sequence[int], cp_size: int) -> tuple[float, float, float]:
        arr = self._checked_lengths(lengths, cp_size)
        if arr is None:
            return 0.0, 0.0, 0.0
        local, compute, attn = self.doc_terms(arr, cp_size)
        return float(local.sum()), float(compute.sum()), float(attn.sum())

    def _local_sum(self, lengths: Sequence[int], cp_size: int) -> float:
        """`_sums(...)[0]` without the time terms (validate calls it per micro-batch): each document's
        padded tokens per rank are whole numbers, so the float sum is exact in any order."""
        arr = self._checked_lengths(lengths, cp_size)
        if arr is None:
            return 0.0
        return float(int(local_tokens(arr, cp_size).sum()))

    def microbatch_time(self, lengths: Sequence[int], cp_size: int, *, first_rank: int = 0,
                        recompute: Recompute = NO_RECOMPUTE) -> float:
        """Seconds for one pipeline stage of the micro-batch on a CP group of `cp_size` ranks."""
        return self.time_from_sums(*self._sums(lengths, cp_size), cp_size, first_rank, recompute)

    def ulysses_time(self, lengths: Sequence[int], cp_size: int, *, first_rank: int = 0,
                     recompute: Recompute = NO_RECOMPUTE) -> float | None:
        """Seconds of the micro-batch with Ulysses CP attention (`TimeModel.ulysses_from_sums`); None where it may
        not run (not allowed, CP 1, or heads that do not split over the group)."""
        if not self.time.ulysses_runs(cp_size):
            return None
        return self.time.ulysses_from_sums(*self._sums(lengths, cp_size), cp_size, first_rank, recompute)

    def microbatch_memory(self, lengths: Sequence[int], cp_size: int, *,
                          recompute: Recompute = NO_RECOMPUTE) -> int:
        """Peak bytes per rank: static state + this micro-batch's activations and logits."""
        return self.memory_from_tokens(self._local_sum(lengths, cp_size), recompute, cp_size)

    def fits(self, lengths: Sequence[int], cp_size: int, *, recompute: Recompute = NO_RECOMPUTE) -> bool:
        return self.microbatch_memory(lengths, cp_size, recompute=recompute) <= self.cluster.mem_budget_bytes

    def best_recompute(self, lengths: Sequence[int], cp_size: int) -> Recompute | None:
        """Fastest allowed recompute with which the micro-batch fits; None if none does."""
        return self.best_recompute_from_sums(*self._sums(lengths, cp_size), cp_size)

    @staticmethod
    def padded(lengths: np.ndarray, cp_size: int) -> np.ndarray:
        """Each length padded to a multiple of 2·cp_size (planner/padding.py's rule)."""
        return padded_length(lengths, cp_size)
