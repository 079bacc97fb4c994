"""Cost model: time and per-rank memory of one micro-batch (docs/cost_model.md).

A micro-batch is a list of documents packed THD and run by a CP group of c ranks in
lock-step. Each document is padded to a multiple of 2c (zig-zag chunks), so padding is paid.

time = overhead
     + compute            Σ_docs (a·Lp + b(Lp)·Lp²) / c + d per document, per pipeline stage
     + recompute          full k of n layers: (k/n)·(1/3)·compute; selective: attention forward
     + MoE all-to-alls    EP token dispatch + combine, per MoE layer and pass, not overlapped (moe_cost.py)
     + ZeRO-3 gathers     weight all-gathers and gradient reduce-scatters, what the compute does not hide
     + exposed CP comm    K/V bytes each rank receives ((c-1)/c of the group's K/V per layer and
                          pass; 3 passes fwd+bwd: K/V gather, again in backward, dK/dV reduce),
                          overlapped with attention so only the excess shows, + per-collective latency
a = linear FLOPs per token / (tp·pp·gemm rate); b(Lp) = attention FLOPs per L² / (tp·pp·attn_rate(Lp/c)):
the attention kernel works on the rank's chunk, so short chunks run at the short-document rate.

memory per rank = static (bf16 weights 2 B + fp32 grads 4 B per parameter, Adam fp32 master +
two moments 12 B sharded over the domain with the distributed optimizer; all /(tp·pp); an MoE's experts
/(tp·pp·ep), their optimizer states sharded over the domain / ep, their expert-data-parallel ranks;
ZeRO-2 / ZeRO-3 shard gradients / weights too, and ZeRO-3 gathers weights per micro-batch: param_sharding.py)
+ activations per token per layer: what megatron-core 0.19.2 keeps per tensor (activations.py: SwiGLU,
GQA, MoE, TP/SP, TE vs local spec); a micro-batch's relief (relief.py: recompute modules, offload, or full
recompute of k layers, which keeps the layer input plus one layer's working set while recomputing) frees
some of it
+ under FP8 / with NCCL communicators: gpu_costs.py (FP8 weight copies, per-communicator buffers)
+ the output layer at the cross-entropy peak on the last stage: bf16 logits (2 B) and their fp32 upcast
(4 B) of vocab/tp per token, both alive (docs/cost_model.md, "The output layer"). Activations and logits are per local
token (padded tokens / c). With PP, stage 0 holds pp micro-batches in flight (1F1B); the
bound used is max(pp·activations, activations + logits).

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
recomputed layer's) replaces the 34 / 32 / 2 above, `output_bytes_per_vocab` (per local token per
vocab/tp unit, outside the layers) the output layer's 6.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from dcp_megatron.planner.cluster import ClusterSpec
from dcp_megatron.planner.cost_profile import (PROFILE_SCALARS, RECOMPUTE_KINDS, check_allowed_recompute,  # noqa: F401
                                               check_cp_attention, check_profile, load_profile)
from dcp_megatron.planner.gpu_costs import GpuCosts
from dcp_megatron.planner.model import ModelShape
from dcp_megatron.planner.activations import full_layer_bytes, layer_tensors
from dcp_megatron.planner.moe_cost import MoeComm
from dcp_megatron.planner.param_sharding import ParamGathers, static_state_bytes
from dcp_megatron.planner.plan import NO_RECOMPUTE, SELECTIVE, Recompute
from dcp_megatron.planner.memory_spec import spec_output_bytes
from dcp_megatron.planner.relief import (ReliefCosts, allows, held_bytes_per_layer,
                                         light_reliefs, menu_names, offload_kept_bytes,
                                         stage_peak_bytes)

CP_PASSES = 3                       # K/V gather forward, again in backward, dK/dV reduce-scatter
# bf16 logits + the fp32 copy vocab_parallel_cross_entropy makes of them (alive together), per vocab/tp unit
OUTPUT_BYTES_PER_VOCAB = 2 + 4


class CostModel:
    """Scores micro-batches; the same instance scores every policy."""

    def __init__(self, model: ModelShape, cluster: ClusterSpec, *, profile: dict | None = None,
                 allowed_recompute=RECOMPUTE_KINDS, time_scale: dict | None = None,
                 cp_attention: tuple[str, ...] = ("allgather",), gpu: GpuCosts = GpuCosts()) -> None:
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
        # Measured corrections (planner/refine.py): micro-batch seconds x factor per (cp size, relief name).
        self.time_scale: dict[tuple[int, str], float] = dict(time_scale or {})
        bad = {k: v for k, v in self.time_scale.items() if not (math.isfinite(v) and v > 0)}
        if bad:
            raise ValueError(f"time_scale factors must be positive and finite, got {bad}")
        self._attn_table: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._max_local: dict[Recompute, int] = {}    # memoised per recompute policy
        self._bytes_per_token: dict[Recompute, float] = {}
        self._memo: dict = {}                          # see `memoised`
        if profile is not None:
            check_profile(profile)
            changes = {k: profile[k] for k in PROFILE_SCALARS if k in profile}
            if "attn_rate_points" in profile:
                changes["attn_rate_points"] = tuple(sorted((int(L), float(r)) for L, r in profile["attn_rate_points"]))
            cluster = dataclasses.replace(cluster, **changes)
            for L, cp, sec in sorted(profile.get("attention_times", ())):
                self._attn_table.setdefault(int(cp), ([], []))
                self._attn_table[int(cp)][0].append(math.log(L))
                self._attn_table[int(cp)][1].append(math.log(sec))
            self._attn_table = {cp: (np.array(x), np.array(y)) for cp, (x, y) in self._attn_table.items()}
        self.model = model
        self.cluster = cluster
        m = model
        if cluster.domain_size % m.ep:
            raise ValueError(f"ep={m.ep} does not divide the domain of {cluster.domain_size} ranks "
                             f"(EP groups are carved out of the DP x CP ranks)")
        self.moe = MoeComm.of(m, cluster)    # EP all-to-alls (zero for dense models and EP 1)
        self.layers_per_stage = m.num_layers // m.pp
        split = m.tp * m.pp
        self._linear_s_per_token = m.linear_flops_per_token / (split * gpu.gemm_rate(cluster))
        self._attn_flops_per_len2 = m.attn_flops_per_len2 / split
        self._rate_log_len = np.log([float(L) for L, _ in cluster.attn_rate_points])
        self._rate_values = np.array([float(r) for _, r in cluster.attn_rate_points])
        kv_heads_per_rank = max(m.num_kv_heads / m.tp, 1.0)
        self._heads_per_rank = max(m.num_heads // m.tp, 1)
        self._kv_heads_per_rank = max(m.num_kv_heads // m.tp, 1)
        self._kv_bytes_per_token = 2 * kv_heads_per_rank * m.head_dim * 2 * self.layers_per_stage
        self._relief_costs = ReliefCosts(m, cluster, self.moe, self.layers_per_stage)
        light = light_reliefs(m, self.allowed_recompute, can_offload=cluster.host_link_bw > 0)
        self._init_layer_bytes(m, light, (profile or {}).get("activation_bytes_per_hidden", {}))
        per_vocab, per_token = spec_output_bytes(m, m.activations) if m.activations else (OUTPUT_BYTES_PER_VOCAB, 0.0)
        self._logit_bytes_per_token = (profile or {}).get("output_bytes_per_vocab", per_vocab) * m.vocab_size / m.tp \
            + per_token
        self._latency_per_mb = cluster.collective_latency_s * self.layers_per_stage * CP_PASSES
        # weights, gradients, optimizer states as the ZeRO stage shards them; stage 3's weight gathers
        self.static_bytes = static_state_bytes(m, cluster) + gpu.static_bytes(m, cluster)
        self.param_gathers = ParamGathers.of(m, cluster)
        self._none_bytes_per_token = self._bytes_per_local_token(NO_RECOMPUTE)
        self._full_options = [Recompute("full", k) for k in range(1, self.layers_per_stage + 1)]
        allowed = self.allowed_recompute
        self._light_options = light
        self._options = self._light_options + (self._full_options if "full" in allowed else [])
        # base: what a micro-batch gets when memory is no issue (none when allowed: the fastest);
        # strongest: the one holding the most tokens (the last option: memory falls along the list)
        self.base_recompute = self._options[0]
        self.strongest_recompute = self._options[-1]
        self._full_bytes_per_token = np.array([self.bytes_per_local_token(r) for r in self._full_options])
        self._none_max_local = None
        self._none_max_local = self.max_local_tokens(NO_RECOMPUTE)

    def _init_layer_bytes(self, m, light, measured: dict) -> None:
        """Bytes per local token one layer keeps, per light relief and fully recomputed (activations.py); a
        profile's measured factors (per hidden/tp unit) scale the table to its "none", and replace core-attention
        recompute's ("selective") and a recomputed layer's ("full")."""
        unit = m.hidden_size / m.tp
        tensors = layer_tensors(m)
        none = float(sum(tensors.values()))
        scale = measured["none"] * unit / none if "none" in measured else 1.0
        self._layer_bytes = {r: held_bytes_per_layer(m, r, tensors) * scale for r in set(light) | {NO_RECOMPUTE}}
        if "selective" in measured:
            self._layer_bytes[SELECTIVE] = measured["selective"] * unit
        self._layer_bytes_none = self._layer_bytes[NO_RECOMPUTE]
        self._layer_bytes_full = measured["full"] * unit if "full" in measured else full_layer_bytes(m)

    def allows(self, recompute: Recompute) -> bool:
        """Whether plans may use this relief (the menu `allowed_recompute` names; validate checks plans)."""
        return allows(self.allowed_recompute, recompute) and (recompute.kind == "full" or recompute in self._layer_bytes)

    def with_time_scale(self, time_scale: dict) -> "CostModel":
        """The same cost model with micro-batch times scaled per (cp size, relief name: str(Recompute))."""
        model, cluster, profile = self._init_args
        return CostModel(model, cluster, profile=profile, allowed_recompute=self.allowed_recompute,
                         time_scale=time_scale, gpu=self.gpu,
                         cp_attention=("ulysses",) if self.prefer_ulysses else self.cp_attention)

    def _scaled(self, t, cp_sizes, recompute: Recompute):
        """t x the measured factor of (cp size, this relief: refine.py); cp_sizes an int or an array like t."""
        if not self.time_scale:
            return t
        if np.ndim(cp_sizes) == 0:
            return t * self.time_scale.get((int(cp_sizes), str(recompute)), 1.0)
        sizes, where = np.unique(np.asarray(cp_sizes), return_inverse=True)
        factors = np.array([self.time_scale.get((int(c), str(recompute)), 1.0) for c in sizes])
        return t * factors[where].reshape(np.shape(t))

    def memoised(self, key, make):
        """make() once per key for this cost model: run-wide values a policy derives from the
        cost model alone (e.g. the static layout of a length cap), not per batch."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    # ---- per-document pieces (vectorised) ------------------------------------------------
    @staticmethod
    def padded(lengths: np.ndarray, cp_size: int) -> np.ndarray:
        step = 2 * cp_size
        return -(-lengths // step) * step

    def doc_terms(self, lengths, cp_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per document at CP size c: (local tokens per rank, compute seconds, attention seconds)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        lp = self.padded(lengths, cp_size).astype(np.float64)
        local = lp / cp_size
        attn = self._attention_seconds(lp, cp_size)
        return local, local * self._linear_s_per_token + attn + self.cluster.document_overhead_s, attn

    def ideal_doc_seconds(self, lengths) -> tuple[np.ndarray, np.ndarray]:
        """Per document at CP size 1, unpadded: (compute seconds, attention seconds)."""
        lengths = np.asarray(lengths, dtype=np.float64)
        attn = self._attention_seconds(lengths, 1)
        return lengths * self._linear_s_per_token + attn + self.cluster.document_overhead_s, attn

    def ideal_rank_seconds(self, lengths) -> float:
        """Σ compute of the documents at CP size 1, unpadded: the work no layout can avoid."""
        return float(self.ideal_doc_seconds(lengths)[0].sum())

    def doc_alone_seconds(self, lengths, cp_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Each document alone in a micro-batch at CP size c, placed at rank 0, with the fastest
        recompute that fits (inf where none does), without the per-micro-batch overhead.
        Returns (local tokens, compute s, attention s, seconds); vectorised for planning."""
        local, compute, attn = self.doc_terms(lengths, cp_size)
        seconds = compute + self.moe.seconds(local)
        if cp_size > 1:
            bw = self.cluster.intra_node_bw if self.cluster.same_node(0, cp_size) else self.cluster.inter_node_bw
            received = CP_PASSES * self._kv_bytes_per_token * local * (cp_size - 1)
            exposed = np.maximum(received / bw - attn * self.gpu.overlapped_share(cp_size), 0.0)
            seconds += (self._cp_comm_seconds(exposed, local, CP_PASSES, cp_size, bw)
                        + self._latency_per_mb * self.gpu.collectives_per_pass(cp_size))
        overhead = self.cluster.microbatch_overhead_s
        if self.base_recompute is not NO_RECOMPUTE:
            return local, compute, attn, self._fastest_alone_seconds(local, compute, attn, cp_size) - overhead
        for j in np.flatnonzero(local > self.max_local_tokens(NO_RECOMPUTE)).tolist():
            rc = self.best_recompute_from_sums(float(local[j]), float(compute[j]), float(attn[j]), cp_size)
            seconds[j] = (math.inf if rc is None else
                          self.time_from_sums(float(local[j]), float(compute[j]), float(attn[j]), cp_size, 0, rc)
                          - overhead)
        return local, compute, attn, seconds

    def _fastest_alone_seconds(self, local, compute, attn, cp_size: int) -> np.ndarray:
        """Per document alone at rank 0: the least time over the allowed recompute that fit."""
        room = self.cluster.mem_budget_bytes - self.static_bytes
        first = np.zeros(local.shape, dtype=np.int64)
        best = np.full(local.shape, math.inf)
        for r in self._options:
            t = self.times_from_sums(local, compute, attn, cp_size, first, r)
            best = np.where((local * self.bytes_per_local_token(r) <= room) & (t < best), t, best)
        return best

    def _attention_seconds(self, lp: np.ndarray, cp_size: int) -> np.ndarray:
        if self._attn_table:
            usable = [cp for cp in self._attn_table if cp <= cp_size] or [min(self._attn_table)]
            cp_row = max(usable)
            xs, ys = self._attn_table[cp_row]
            logl = np.log(lp)
            t = np.exp(np.interp(logl, xs, ys))
            beyond = logl > xs[-1]
            t = np.where(beyond, np.exp(ys[-1] + 2.0 * (logl - xs[-1])), t)
            return t * (cp_row / cp_size)
        rate = np.interp(np.log(lp / cp_size), self._rate_log_len, self._rate_values)
        return self._attn_flops_per_len2 * lp * lp / (rate * cp_size)

    # ---- from sums over a micro-batch's documents ----------------------------------------
    def recompute_extra(self, compute_s, attn_s, recompute: Recompute, local_tokens=0.0):
        """(added compute seconds, K/V communication passes) of a recompute policy; scalars or arrays.

        Full recompute of k of n layers reruns k/n of the forward (1/3 of fwd+bwd) and its CP
        all-gathers; selective reruns the attention forward."""
        if recompute.kind == "full":
            frac = recompute.full_layers / self.layers_per_stage
            return self.full_recompute_seconds(compute_s, recompute.full_layers), CP_PASSES + frac
        if recompute is NO_RECOMPUTE:
            return 0.0, CP_PASSES
        return (self._relief_costs.extra_seconds(local_tokens, compute_s, attn_s, recompute),
                CP_PASSES + ("core_attn" in recompute.modules))   # recomputed core attention re-gathers K/V

    def full_recompute_seconds(self, compute_s, full_layers):
        """Added seconds of full recompute of `full_layers` layers; either argument may be an array."""
        return full_layers / self.layers_per_stage * compute_s / 3.0 * self.cluster.recompute_cost_factor

    def time_from_sums(self, local_tokens: float, compute_s: float, attn_s: float, cp_size: int,
                       first_rank: int, recompute: Recompute) -> float:
        if local_tokens <= 0:
            return self.cluster.microbatch_overhead_s
        extra, passes = self.recompute_extra(compute_s, attn_s, recompute, local_tokens)
        t = (self.cluster.microbatch_overhead_s + compute_s + extra
             + self.moe.seconds(local_tokens, recompute.full_layers))
        if self.param_gathers.active:
            t += self.param_gathers.seconds(compute_s + extra)
        if cp_size > 1:
            bw = (self.cluster.intra_node_bw if self.cluster.same_node(first_rank, cp_size)
                  else self.cluster.inter_node_bw)
            received = passes * self._kv_bytes_per_token * local_tokens * (cp_size - 1)
            exposed = max(received / bw - attn_s * passes / CP_PASSES * self.gpu.overlapped_share(cp_size), 0.0)
            t += (float(self._cp_comm_seconds(exposed, local_tokens, passes, cp_size, bw))
                  + self._latency_per_mb * self.gpu.collectives_per_pass(cp_size))
            if recompute.offload and not self.cluster.same_node(first_rank, cp_size):
                t += float(self._relief_costs.nic_contention_seconds(local_tokens, compute_s, recompute, received,
                                                                     passes))
        return float(self._scaled(t, cp_size, recompute))

    def times_from_sums(self, local_tokens: np.ndarray, compute_s: np.ndarray, attn_s: np.ndarray,
                        cp_sizes, first_ranks: np.ndarray, recompute: Recompute) -> np.ndarray:
        """`time_from_sums` of many micro-batches at once (the same floats); cp_sizes int or array."""
        extra, passes = self.recompute_extra(compute_s, attn_s, recompute, local_tokens)
        t = (self.cluster.microbatch_overhead_s + compute_s + extra
             + self.moe.seconds(local_tokens, recompute.full_layers))
        if self.param_gathers.active:
            t = t + self.param_gathers.seconds(compute_s + extra)
        cp_sizes = np.broadcast_to(np.asarray(cp_sizes, dtype=np.int64), t.shape)
        if (cp_sizes > 1).any():
            per_node = self.cluster.gpus_per_node
            same_node = first_ranks // per_node == (first_ranks + cp_sizes - 1) // per_node
            bw = np.where(same_node, self.cluster.intra_node_bw, self.cluster.inter_node_bw)
            received = passes * self._kv_bytes_per_token * local_tokens * (cp_sizes - 1)
            exposed = np.maximum(received / bw - attn_s * passes / CP_PASSES * self.gpu.overlapped_share(cp_sizes), 0.0)
            comm = self._cp_comm_seconds(exposed, local_tokens, passes, cp_sizes, bw)
            if recompute.offload:   # inter-node CP traffic shares the host link with the copies (relief.py)
                comm = comm + self._relief_costs.nic_contention_seconds(
                    local_tokens, compute_s, recompute, np.where(same_node, 0.0, received), passes)
            t = np.where(cp_sizes > 1, t + (comm + self._latency_per_mb * self.gpu.collectives_per_pass(cp_sizes)), t)
        t = self._scaled(t, cp_sizes, recompute)
        return np.where(local_tokens <= 0, self.cluster.microbatch_overhead_s, t)

    def _ulysses_comm_seconds(self, local_tokens, passes, cp_sizes, bw):
        """Seconds of Ulysses' all-to-alls of q, k, v and the output per pass ((c - 1)/c of the local rows each,
        not overlapped); inf where it may not run (not allowed, or heads that do not split over c)."""
        cp = np.asarray(cp_sizes, dtype=np.int64)
        heads, kv_heads = self._heads_per_rank, self._kv_heads_per_rank
        if "ulysses" not in self.cp_attention:
            return np.full(np.broadcast(cp, local_tokens).shape, np.inf)
        ok = (cp > 1) & (heads % np.maximum(cp, 1) == 0)
        kv_moved = np.where(kv_heads % np.maximum(cp, 1) == 0, kv_heads, heads)
        bytes_per_token = (2 * heads + 2 * kv_moved) * self.model.head_dim * 2 * self.layers_per_stage
        sent = passes * bytes_per_token * local_tokens * (cp - 1) / np.maximum(cp, 1)
        return np.where(ok, sent / bw, np.inf)

    def _cp_comm_seconds(self, allgather_exposed, local_tokens, passes, cp_sizes, bw):
        """The exposed CP communication of the flavour the plan will use: the all-gather's, or Ulysses' where
        it is allowed and faster (everywhere it can run with `prefer_ulysses`); see policies/cp_flavour.py."""
        if "ulysses" not in self.cp_attention:
            return allgather_exposed
        ulysses = self._ulysses_comm_seconds(local_tokens, passes, cp_sizes, bw)
        if self.prefer_ulysses:
            return np.where(np.isfinite(ulysses), ulysses, allgather_exposed)
        return np.minimum(allgather_exposed, ulysses)

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
            return (n - k) * self._layer_bytes_none + k * self._layer_bytes_full
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
        return self._held_per_layer(recompute) + self._logit_bytes_per_token

    def _bytes_per_local_token(self, recompute: Recompute) -> float:
        if self.model.activations is not None:     # the loss's peak or a layer's backward, whichever is higher
            held = self._held_per_layer(recompute)
            peak = stage_peak_bytes(self.model, recompute, held=held, none_bytes=self._layer_bytes_none,
                                    full_bytes=self._layer_bytes_full, output_bytes=self._logit_bytes_per_token,
                                    layers=self.layers_per_stage)
            return max(self.model.pp * (peak - self._logit_bytes_per_token), peak)
        # full recompute: one layer's working set (a non-recomputed layer's activations) while it reruns
        working = self._layer_bytes_none if recompute.kind == "full" else 0.0
        act = self._held_per_layer(recompute) + working
        return max(self.model.pp * act, act + self._logit_bytes_per_token)

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

    def full_recompute_options(self) -> list[Recompute]:
        """The full-recompute policies of 1..n layers, allowed or not: memory falls along the list."""
        return list(self._full_options)

    def full_recompute_bytes(self) -> np.ndarray:
        """bytes_per_local_token of each of full_recompute_options() (read-only, cached)."""
        return self._full_bytes_per_token

    def recompute_options(self) -> list[Recompute]:
        """The allowed reliefs: the light ones (none, recompute modules, offload; relief.py) most bytes kept first,
        then full 1..n (memory falls along those)."""
        return list(self._options)

    def choose_recompute(self, local_tokens: float, compute_s: float, attn_s: float,
                         cp_size: int) -> Recompute | None:
        """`best_recompute_from_sums` with a shortcut for the common case: none when it fits (the fastest, unless
        measured corrections (`time_scale`) make another relief faster)."""
        if (self.base_recompute is NO_RECOMPUTE and not self.time_scale
                and local_tokens <= self.max_local_tokens(NO_RECOMPUTE)):
            return NO_RECOMPUTE
        return self.best_recompute_from_sums(local_tokens, compute_s, attn_s, cp_size)

    def best_recompute_from_sums(self, local_tokens: float, compute_s: float, attn_s: float,
                                 cp_size: int) -> Recompute | None:
        """Fastest allowed relief that fits: a light one (relief.py's menu) or the fewest full layers that fit."""
        fitting = self.fitting_reliefs(local_tokens)
        if not fitting:
            return None
        return min(fitting, key=lambda r: (self.time_from_sums(local_tokens, compute_s, attn_s, cp_size, 0, r)))

    def fitting_reliefs(self, local_tokens: float) -> list[Recompute]:
        """The reliefs worth trying for a micro-batch of `local_tokens` per rank: the light ones that fit and, unless
        none fits, the fewest full layers that fit (more layers only add time)."""
        room = self.cluster.mem_budget_bytes - self.static_bytes
        fitting = [r for r in self._light_options if local_tokens * self.bytes_per_local_token(r) <= room]
        if "full" in self.allowed_recompute and (not fitting or fitting[0] is not NO_RECOMPUTE):
            k = self._fewest_full_layers(local_tokens, room)
            if k is not None:
                fitting.append(self._full_options[k - 1])
        return fitting

    def _fewest_full_layers(self, local_tokens: float, room: float) -> int | None:
        # memory falls as k grows: the first k = 1..n whose bytes fit (bytes_per_local_token's floats)
        k = int(np.searchsorted(-self._full_bytes_per_token, -room / local_tokens, side="left")) if local_tokens else 0
        while k > 0 and local_tokens * self._full_bytes_per_token[k - 1] <= room:
            k -= 1                          # guard the division's rounding: step back while the product fits
        while k < len(self._full_options) and local_tokens * self._full_bytes_per_token[k] > room:
            k += 1
        return k + 1 if k < len(self._full_options) else None

    # ---- the public API ------------------------------------------------------------------
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
        padded tokens per rank are 2·ceil(L / 2c), whole numbers, so the float sum is exact in any order."""
        arr = self._checked_lengths(lengths, cp_size)
        if arr is None:
            return 0.0
        return float(2 * int((-(-arr // (2 * cp_size))).sum()))

    def microbatch_time(self, lengths: Sequence[int], cp_size: int, *, first_rank: int = 0,
                        recompute: Recompute = NO_RECOMPUTE) -> float:
        """Seconds for one pipeline stage of the micro-batch on a CP group of `cp_size` ranks."""
        return self.time_from_sums(*self._sums(lengths, cp_size), cp_size, first_rank, recompute)

    def ulysses_time(self, lengths: Sequence[int], cp_size: int, *, first_rank: int = 0,
                     recompute: Recompute = NO_RECOMPUTE) -> float | None:
        """Seconds of the micro-batch with Ulysses CP attention; None where it may not run (not allowed, CP 1,
        or heads that do not split over the group).

        Same compute as the all-gather flavour (every rank runs whole documents for H/c heads); the
        communication is an all-to-all of q, k, v and the output in forward, of their gradients in backward
        (and again per recompute pass): (c - 1)/c of this rank's rows each, none of it overlapped."""
        if "ulysses" not in self.cp_attention or cp_size < 2 or self._heads_per_rank % cp_size:
            return None
        local, compute_s, attn_s = self._sums(lengths, cp_size)
        if local <= 0:
            return self.cluster.microbatch_overhead_s
        extra, passes = self.recompute_extra(compute_s, attn_s, recompute, local)
        bw = self.cluster.intra_node_bw if self.cluster.same_node(first_rank, cp_size) else self.cluster.inter_node_bw
        comm = float(self._ulysses_comm_seconds(local, passes, cp_size, bw))
        if recompute.offload and not self.cluster.same_node(first_rank, cp_size):   # the NIC shares the host link
            comm += float(self._relief_costs.nic_contention_seconds(local, compute_s, recompute, comm * bw, passes))
        t = (self.cluster.microbatch_overhead_s + compute_s + extra + comm + self._latency_per_mb
             + self.moe.seconds(local, recompute.full_layers))
        return float(self._scaled(t, cp_size, recompute))

    def microbatch_memory(self, lengths: Sequence[int], cp_size: int, *,
                          recompute: Recompute = NO_RECOMPUTE) -> int:
        """Peak bytes per rank: static state + this micro-batch's activations and logits."""
        return self.memory_from_tokens(self._local_sum(lengths, cp_size), recompute)

    def fits(self, lengths: Sequence[int], cp_size: int, *, recompute: Recompute = NO_RECOMPUTE) -> bool:
        return self.microbatch_memory(lengths, cp_size, recompute=recompute) <= self.cluster.mem_budget_bytes

    def best_recompute(self, lengths: Sequence[int], cp_size: int) -> Recompute | None:
        """Fastest allowed recompute with which the micro-batch fits; None if none does."""
        return self.best_recompute_from_sums(*self._sums(lengths, cp_size), cp_size)

