"""Fitting the cost model's constants to measured micro-batches, and scoring the fit on held-back ones.

The profiler (dcp_megatron/megatron/profiler.py) runs a grid of micro-batches (document lengths x
packing x recompute x CP size) through the user's model and hands this module one `Measurement`
per grid point. `fit_profile` turns the fit share into the profile JSON `--dcp-profile` reads
(cost.py's schema), each constant from the measurements the cost model uses it for:

- microbatch_overhead_s and gemm_flops: least squares of (time - attention time) = overhead +
  a x local tokens over the no-recompute points; the profiler times the core attention inside
  the model, so the linear part is measured, not guessed; gemm_flops = linear FLOPs per token /
  (tp x a);
- attention_times: per (padded length, CP size) the measured attention seconds per document and
  rank (less the modelled per-micro-batch collective latency at CP > 1, which the cost model adds
  itself); packed points give rows for their short documents;
- recompute_cost_factor: least squares through 0 of each recompute point's extra time (measured
  minus the fitted model's time without recompute) against the share the cost model charges;
- activation_bytes_per_hidden / output_bytes_per_vocab: bytes saved for backward per local token,
  per layer per hidden/tp unit inside the transformer block (per recompute kind) and per vocab/tp
  unit outside it (embedding, output layer, loss);
- intra_node_bw / collective_latency_s: passed through from the profiler's all-gather timings.

`score_profile` predicts the held-back points with a CostModel built from the fitted profile and
reports per-point relative errors of time and memory, with their median and maximum. Pure numpy:
the planner never imports torch.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass

import numpy as np

from dcp_megatron.planner.cluster import ClusterSpec
from dcp_megatron.planner.cost import CP_PASSES, CostModel, check_profile
from dcp_megatron.planner.model import ModelShape
from dcp_megatron.planner.plan import NO_RECOMPUTE, Recompute


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """One grid point as measured (per rank; the slowest rank of the world for times and bytes)."""

    lengths: tuple[int, ...]
    cp_size: int
    recompute: Recompute
    seconds: float                 # forward + backward of the micro-batch
    attention_seconds: float       # of which inside the core attention (forward + backward)
    saved_bytes: float             # bytes saved for backward during the forward (activations)
    block_saved_bytes: float       # of which inside the transformer block (the layers)
    held_back: bool = False        # scored, not fitted

    def __post_init__(self) -> None:
        if not self.lengths or min(self.lengths) <= 0:
            raise ValueError(f"a measurement needs positive document lengths, got {self.lengths}")
        for name in ("seconds", "attention_seconds", "saved_bytes", "block_saved_bytes"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"measurement {name} must be finite and >= 0, got {value}")

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["lengths"] = list(self.lengths)
        out["recompute"] = str(self.recompute)
        return out


def local_tokens(lengths, cp_size: int) -> float:
    """Padded tokens per rank (each document padded to a multiple of 2c, as the runtime shards)."""
    return float(CostModel.padded(np.asarray(lengths, dtype=np.int64), cp_size).sum()) / cp_size


def _fit_linear(points: list[Measurement]) -> tuple[float, float]:
    """(overhead s, s per local token) of the linear part; the overhead is clipped at 0."""
    x = np.array([local_tokens(m.lengths, m.cp_size) for m in points])
    y = np.array([max(m.seconds - m.attention_seconds, 0.0) for m in points])
    if len(points) >= 2 and np.ptp(x) > 0:
        slope, intercept = np.polyfit(x, y, 1)
        if intercept >= 0 and slope > 0:
            return float(intercept), float(slope)
    return 0.0, float(max(np.dot(x, y) / np.dot(x, x), 1e-12))


def _attention_rows(points: list[Measurement], latency_per_mb: float) -> list[list[float]]:
    """[padded length, cp, seconds per document per rank]: the geometric mean per (length, cp)."""
    samples: dict[tuple[int, int], list[float]] = {}
    for m in points:
        padded = CostModel.padded(np.asarray(m.lengths, dtype=np.int64), m.cp_size)
        if len(set(padded.tolist())) != 1:
            continue                       # mixed lengths: the split per document is unknown
        attention = m.attention_seconds - (latency_per_mb if m.cp_size > 1 else 0.0)
        per_doc = max(attention, 0.1 * m.attention_seconds, 1e-9) / len(m.lengths)
        samples.setdefault((int(padded[0]), m.cp_size), []).append(per_doc)
    return [[length, cp, float(math.exp(statistics.fmean(math.log(s) for s in secs)))]
            for (length, cp), secs in sorted(samples.items())]


def _share(cost: CostModel, m: Measurement) -> float:
    """Seconds the cost model charges m's recompute per unit of recompute_cost_factor."""
    local, compute, attn = cost._sums(m.lengths, m.cp_size)
    if m.recompute.kind == "full":
        return m.recompute.full_layers / cost.layers_per_stage * compute / 3.0
    if m.recompute.kind == "selective":
        return attn / 3.0
    return 0.0


def _memory_factors(points: list[Measurement], shape: ModelShape, num_layers: int) -> tuple[dict, float]:
    """Bytes per local token: per layer per hidden/tp unit by recompute kind, and outside the block per vocab/tp."""
    hidden_unit = shape.hidden_size / shape.tp
    vocab_unit = shape.vocab_size / shape.tp

    def per_layer_unit(m: Measurement) -> float:
        return m.block_saved_bytes / (local_tokens(m.lengths, m.cp_size) * hidden_unit)

    by_kind: dict[str, list[float]] = {}
    for m in points:
        by_kind.setdefault(m.recompute.kind, []).append(m)
    if "none" not in by_kind:
        raise ValueError("the profile grid needs points without recompute")
    factors = {"none": statistics.median(per_layer_unit(m) / num_layers for m in by_kind["none"])}
    if "selective" in by_kind:
        factors["selective"] = statistics.median(per_layer_unit(m) / num_layers for m in by_kind["selective"])
    if "full" in by_kind:   # k of n layers recomputed: (n - k) x none + k x full per token
        factors["full"] = statistics.median(
            max(per_layer_unit(m) - (num_layers - m.recompute.full_layers) * factors["none"], 0.0)
            / m.recompute.full_layers for m in by_kind["full"])
    outside = statistics.median((m.saved_bytes - m.block_saved_bytes) / (local_tokens(m.lengths, m.cp_size)
                                                                         * vocab_unit) for m in points)
    return {k: float(max(v, 1e-6)) for k, v in factors.items()}, float(max(outside, 1e-6))


def fit_profile(measurements: list[Measurement], shape: ModelShape, cluster: ClusterSpec, *,
                intra_node_bw: float, collective_latency_s: float, meta: dict | None = None) -> dict:
    """The profile JSON of the profiled model (`shape`: its layers, tp, pp 1) from the fit measurements."""
    fit = [m for m in measurements if not m.held_back]
    plain = [m for m in fit if m.recompute == NO_RECOMPUTE]
    if len(plain) < 2:
        raise ValueError(f"the profile needs at least 2 fitted points without recompute, got {len(plain)}")
    overhead, per_token = _fit_linear(plain)
    latency_per_mb = collective_latency_s * shape.num_layers * CP_PASSES
    activation, output = _memory_factors(fit, shape, shape.num_layers)
    profile = {
        "gemm_flops": shape.linear_flops_per_token / (shape.tp * per_token),
        "attention_times": _attention_rows(plain, latency_per_mb),
        "microbatch_overhead_s": overhead,
        "intra_node_bw": intra_node_bw,
        "inter_node_bw": intra_node_bw,
        "collective_latency_s": collective_latency_s,
        "recompute_cost_factor": 1.0,
        "activation_bytes_per_hidden": activation,
        "output_bytes_per_vocab": output,
    }
    recomputed = [m for m in fit if m.recompute != NO_RECOMPUTE]
    if recomputed:
        cost = CostModel(shape, cluster, profile=check_profile(dict(profile)))
        shares = np.array([_share(cost, m) for m in recomputed])
        extras = np.array([m.seconds - cost.microbatch_time(m.lengths, m.cp_size) for m in recomputed])
        if np.dot(shares, shares) > 0:
            profile["recompute_cost_factor"] = float(max(np.dot(shares, extras) / np.dot(shares, shares), 0.05))
    if meta is not None:
        profile["meta"] = meta
    return check_profile(profile)


def scaled_to_stage(profile: dict, *, profiled_layers: int, layers_per_stage: int) -> dict:
    """The profile of the profiled model (a few layers) for the trained model's pipeline stage: attention
    seconds per document and the per-micro-batch overhead grow with the layers (the GEMM rate and the
    per-layer memory factors do not depend on the layer count)."""
    scale = layers_per_stage / profiled_layers
    out = dict(profile)
    out["attention_times"] = [[length, cp, sec * scale] for length, cp, sec in profile["attention_times"]]
    out["microbatch_overhead_s"] = profile["microbatch_overhead_s"] * scale
    return check_profile(out)


def relative_error(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured if measured > 0 else math.inf


def score_profile(profile: dict, measurements: list[Measurement], shape: ModelShape, cluster: ClusterSpec) -> dict:
    """Predicted vs measured time and activation memory of the held-back points (the report JSON)."""
    cost = CostModel(shape, cluster, profile=profile)
    rows = []
    for m in measurements:
        if not m.held_back:
            continue
        local = local_tokens(m.lengths, m.cp_size)
        predicted_s = cost.microbatch_time(m.lengths, m.cp_size, recompute=m.recompute)
        predicted_bytes = local * cost.held_bytes_per_local_token(m.recompute)
        rows.append({**m.to_json(), "local_tokens": local, "predicted_seconds": predicted_s,
                     "time_rel_error": relative_error(predicted_s, m.seconds),
                     "predicted_saved_bytes": predicted_bytes,
                     "memory_rel_error": relative_error(predicted_bytes, m.saved_bytes)})
    if not rows:
        raise ValueError("no held-back points to score")
    time_errors = [r["time_rel_error"] for r in rows]
    memory_errors = [r["memory_rel_error"] for r in rows]
    return {"median_rel_error": statistics.median(time_errors), "max_rel_error": max(time_errors),
            "memory_median_rel_error": statistics.median(memory_errors), "memory_max_rel_error": max(memory_errors),
            "num_fitted": sum(not m.held_back for m in measurements), "num_held_back": len(rows), "points": rows}


def format_report(report: dict) -> str:
    """The held-back table the profiler prints."""
    lines = [f"{'held-back micro-batch':40s} {'measured':>10s} {'predicted':>10s} {'error':>7s}   "
             f"{'saved MiB':>9s} {'predicted':>9s} {'error':>7s}"]
    for r in report["points"]:
        lengths = r["lengths"]
        name = (f"{lengths[0]} tok" if len(lengths) == 1 else f"{len(lengths)} docs/{sum(lengths)} tok") + \
               f" cp{r['cp_size']} {r['recompute']}"
        lines.append(f"{name:40s} {r['seconds'] * 1e3:8.1f}ms {r['predicted_seconds'] * 1e3:8.1f}ms "
                     f"{r['time_rel_error']:6.1%}   {r['saved_bytes'] / 2**20:9.2f} "
                     f"{r['predicted_saved_bytes'] / 2**20:9.2f} {r['memory_rel_error']:6.1%}")
    lines.append(f"time: median error {report['median_rel_error']:.1%}, worst {report['max_rel_error']:.1%}; "
                 f"activation memory: median {report['memory_median_rel_error']:.1%}, worst "
                 f"{report['memory_max_rel_error']:.1%} ({report['num_held_back']} held-back points, "
                 f"{report['num_fitted']} fitted)")
    return "\n".join(lines)
