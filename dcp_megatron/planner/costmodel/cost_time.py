"""Seconds of one micro-batch for one pipeline stage, from its documents' summed terms (docs/cost_model.md).

time = overhead
     + compute            Σ_docs (a·Lp + b(Lp)·Lp²) / c + d per document, per pipeline stage (Lp: planner/padding.py)
     + relief             full k of n layers: (k/n)·(1/3)·compute; recompute modules, offload: relief.py
     + MoE all-to-alls    EP token dispatch + combine, per MoE layer and pass, not overlapped (moe_cost.py)
     + ZeRO-3 gathers     weight all-gathers and gradient reduce-scatters, what the compute does not hide
     + exposed CP comm    K/V bytes each rank receives ((c-1)/c of the group's K/V per layer and
                          pass; 3 passes fwd+bwd: K/V gather, again in backward, dK/dV reduce),
                          overlapped with attention so only the excess shows, + per-collective latency;
                          or Ulysses' all-to-alls where they are allowed and faster
a = linear FLOPs per token / (tp·pp·gemm rate); b(Lp) = attention FLOPs per L² / (tp·pp·attn_rate(Lp/c)):
the attention kernel works on the rank's chunk, so short chunks run at the short-document rate.
"""
from __future__ import annotations

import math

import numpy as np

from dcp_megatron.planner.padding import padded_length
from dcp_megatron.planner.plan import NO_RECOMPUTE, Recompute

CP_PASSES = 3                       # K/V gather forward, again in backward, dK/dV reduce-scatter


class TimeModel:
    """Micro-batch seconds; CostModel builds it and hands out its methods."""

    def __init__(self, model, cluster, *, gpu, moe, param_gathers, relief_costs, layers_per_stage: int,
                 cp_attention: tuple[str, ...], prefer_ulysses: bool, time_scale: dict,
                 attention_times=()) -> None:
        m = model
        self.model, self.cluster, self.gpu, self.moe = model, cluster, gpu, moe
        self.param_gathers, self._relief_costs = param_gathers, relief_costs
        self.layers_per_stage = layers_per_stage
        self.cp_attention, self.prefer_ulysses = cp_attention, prefer_ulysses
        # Measured corrections (planner/costmodel/refine.py): micro-batch seconds x factor per (cp size, relief name).
        self.time_scale: dict[tuple[int, str], float] = time_scale
        table: dict[int, tuple[list, list]] = {}
        for L, cp, sec in sorted(attention_times):
            table.setdefault(int(cp), ([], []))
            table[int(cp)][0].append(math.log(L))
            table[int(cp)][1].append(math.log(sec))
        self._attn_table = {cp: (np.array(x), np.array(y)) for cp, (x, y) in table.items()}
        split = m.tp * m.pp
        self._linear_s_per_token = m.linear_flops_per_token / (split * gpu.gemm_rate(cluster))
        self._attn_flops_per_len2 = m.attn_flops_per_len2 / split
        self._rate_log_len = np.log([float(L) for L, _ in cluster.attn_rate_points])
        self._rate_values = np.array([float(r) for _, r in cluster.attn_rate_points])
        kv_heads_per_rank = max(m.num_kv_heads / m.tp, 1.0)
        self._heads_per_rank = max(m.num_heads // m.tp, 1)
        self._kv_heads_per_rank = max(m.num_kv_heads // m.tp, 1)
        # keys at the q/k head dim, values at the kernel's value head dim (MLA's differ), bf16
        head_dims = m.score_head_dim + m.kernel_value_head_dim
        self._kv_bytes_per_token = kv_heads_per_rank * head_dims * 2 * self.layers_per_stage
        self._latency_per_mb = cluster.collective_latency_s * self.layers_per_stage * CP_PASSES

    def _scaled(self, t, cp_sizes, recompute: Recompute):
        """t x the measured factor of (cp size, this relief: refine.py); cp_sizes an int or an array like t."""
        if not self.time_scale:
            return t
        if np.ndim(cp_sizes) == 0:
            return t * self.time_scale.get((int(cp_sizes), str(recompute)), 1.0)
        sizes, where = np.unique(np.asarray(cp_sizes), return_inverse=True)
        factors = np.array([self.time_scale.get((int(c), str(recompute)), 1.0) for c in sizes])
        return t * factors[where].reshape(np.shape(t))

    # ---- per-document pieces (vectorised) ------------------------------------------------
    def doc_terms(self, lengths, cp_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per document at CP size c: (local tokens per rank, compute seconds, attention seconds)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        lp = padded_length(lengths, cp_size).astype(np.float64)
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

    def alone_seconds(self, local, compute, attn, cp_size: int) -> np.ndarray:
        """Each document alone in a micro-batch at rank 0 without relief or the per-micro-batch overhead: its
        compute, MoE all-to-alls and exposed CP communication (vectorised)."""
        seconds = compute + self.moe.seconds(local)
        if cp_size > 1:
            bw = self.cluster.intra_node_bw if self.cluster.same_node(0, cp_size) else self.cluster.inter_node_bw
            received = CP_PASSES * self._kv_bytes_per_token * local * (cp_size - 1)
            exposed = np.maximum(received / bw - attn * self.gpu.overlapped_share(cp_size), 0.0)
            seconds += (self._cp_comm_seconds(exposed, local, CP_PASSES, cp_size, bw)
                        + self._latency_per_mb * self.gpu.collectives_per_pass(cp_size))
        return seconds

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
        # q and k at the q/k head dim, v and the output at the kernel's value head dim
        head_dims = self.model.score_head_dim + self.model.kernel_value_head_dim
        bytes_per_token = (heads + kv_moved) * head_dims * 2 * self.layers_per_stage
        sent = passes * bytes_per_token * local_tokens * (cp - 1) / np.maximum(cp, 1)
        return np.where(ok, sent / bw, np.inf)

    def _cp_comm_seconds(self, allgather_exposed, local_tokens, passes, cp_sizes, bw):
        """The exposed CP communication of the flavour the plan will use: the all-gather's, or Ulysses' where
        it is allowed and faster (everywhere it can run with `prefer_ulysses`); see planner/cp_flavour.py."""
        if "ulysses" not in self.cp_attention:
            return allgather_exposed
        ulysses = self._ulysses_comm_seconds(local_tokens, passes, cp_sizes, bw)
        if self.prefer_ulysses:
            return np.where(np.isfinite(ulysses), ulysses, allgather_exposed)
        return np.minimum(allgather_exposed, ulysses)

    def ulysses_from_sums(self, local: float, compute_s: float, attn_s: float, cp_size: int, first_rank: int,
                          recompute: Recompute) -> float:
        """Seconds of a micro-batch (its sums) with Ulysses CP attention, where it may run (CostModel.ulysses_time).

        Same compute as the all-gather flavour (every rank runs whole documents for H/c heads); the
        communication is an all-to-all of q, k, v and the output in forward, of their gradients in backward
        (and again per recompute pass): (c - 1)/c of this rank's rows each, none of it overlapped."""
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

    def ulysses_runs(self, cp_size: int) -> bool:
        """Whether Ulysses may run on a group of `cp_size`: allowed, CP > 1, heads that split over the group."""
        return "ulysses" in self.cp_attention and cp_size >= 2 and not self._heads_per_rank % cp_size
