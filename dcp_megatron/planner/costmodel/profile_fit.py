"""Fitting the cost model's constants to measured micro-batches, and scoring the fit on held-back ones.

The profiler (dcp_megatron/training/profiler.py) runs a grid of micro-batches (document lengths x
packing x recompute x CP size) through the user's model and hands this module one `Measurement`
per grid point. `fit_profile` turns the fit share into the profile JSON `--dcp-profile` reads
(cost.py's schema), each constant from the measurements the cost model uses it for:

- microbatch_overhead_s, gemm_flops and document_overhead_s: least squares of (time - attention
  time) = overhead + a x local tokens + d x documents over the no-recompute points (the profiler
  times the core attention inside the model, so the rest is measured, not guessed; d is the work
  launched per document, e.g. Megatron's per-sequence RoPE under THD); gemm_flops = linear FLOPs
  per token / (tp x a);
- attention_times and collective_latency_s: per (padded length, CP size) the measured attention
  seconds per document and rank, and at CP > 1 a fixed part per micro-batch (its K/V collectives'
  latency), fitted together over the points whose documents share one length (recompute points
  too: the attention is timed once, in its grad-enabled forward and its backward); the cost model
  charges the fixed part as collective_latency_s x layers x 3 passes, so that is what it becomes;
- recompute_cost_factor: least squares through 0 of each recompute point's extra time (measured
  minus the same micro-batch measured without recompute, else minus the fitted model's time)
  against the share the cost model charges;
- activation_bytes_per_hidden / output_bytes_per_vocab: bytes saved for backward per local token,
  per layer per hidden/tp unit inside the transformer block (per recompute kind) and per vocab/tp
  unit outside it (embedding, output layer, loss);
- intra_node_bw: passed through from the profiler's all-gather timings (as collective_latency_s
  when no CP > 1 point was run).

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

from dcp_megatron.planner.costmodel.cluster import ClusterSpec
from dcp_megatron.planner.costmodel.cost import CostModel
from dcp_megatron.planner.costmodel.cost_profile import check_profile
from dcp_megatron.planner.costmodel.cost_time import CP_PASSES
from dcp_megatron.planner.padding import padded_length
from dcp_megatron.planner.costmodel.model import ModelShape
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
    return float(padded_length(np.asarray(lengths, dtype=np.int64), cp_size).sum()) / cp_size


def _fit_linear(points: list[Measurement]) -> tuple[float, float, float]:
    """(overhead s per micro-batch, s per local token, s per document) of the time outside the attention:
    non-negative least squares over the three (a coefficient that would come out negative is dropped)."""
    x = np.array([[1.0, local_tokens(m.lengths, m.cp_size), float(len(m.lengths))] for m in points])
    y = np.array([max(m.seconds - m.attention_seconds, 0.0) for m in points])
    active = [0, 1, 2]
    while True:
        coef, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        negative = [a for a, c in zip(active, coef) if c < 0 and a != 1]
        if not negative or len(active) == 1:
            break
        active.remove(negative[0])
    full = dict.fromkeys(range(3), 0.0) | dict(zip(active, coef.tolist()))
    return max(full[0], 0.0), max(full[1], 1e-12), max(full[2], 0.0)


def _attention_fit(points: list[Measurement]) -> tuple[list[list[float]], dict[int, float]]:
    """Attention rows [padded length, cp, seconds per document per rank] and, per CP size > 1, the fixed
    attention seconds of a micro-batch (its K/V collectives' latency, paid once however many documents it
    packs): least squares of attention = fixed + documents x row(length) over the points whose documents
    share one length (singles and packs of the same length tell the two apart)."""
    rows, fixed = [], {}
    for cp in sorted({m.cp_size for m in points}):
        uniform = []
        for m in points:
            padded = padded_length(np.asarray(m.lengths, dtype=np.int64), cp)
            if m.cp_size == cp and len(set(padded.tolist())) == 1:
                uniform.append((int(padded[0]), len(m.lengths), m.attention_seconds))
        lengths = sorted({length for length, _, _ in uniform})
        if not lengths:
            continue
        column = {length: j + 1 for j, length in enumerate(lengths)}
        x = np.zeros((len(uniform), len(lengths) + 1))
        y = np.array([a for _, _, a in uniform])
        for i, (length, count, _) in enumerate(uniform):
            x[i, 0] = 1.0 if cp > 1 else 0.0
            x[i, column[length]] = count
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        base = max(float(coef[0]), 0.0) if cp > 1 else 0.0
        if cp > 1:
            fixed[cp] = base
        for length in lengths:   # refit each row with the fixed part known (a negative coefficient is noise)
            own = [(count, a) for L, count, a in uniform if L == length]
            per_doc = sum(max(a - base, 0.1 * a) for count, a in own) / sum(count for count, _ in own)
            rows.append([length, cp, float(max(per_doc, 1e-9))])
    return rows, fixed


def _share(cost: CostModel, m: Measurement) -> float:
    """Seconds the cost model charges m's recompute per unit of recompute_cost_factor (`cost` has factor 1)."""
    _, compute, attn = cost._sums(m.lengths, m.cp_size)
    return float(cost.recompute_extra(compute, attn, m.recompute)[0])


def _memory_factors(points: list[Measurement], shape: ModelShape) -> tuple[dict, float]:
    """Bytes per local token: per layer per hidden/tp unit by recompute kind, and outside the block per vocab/tp."""
    hidden_unit = shape.hidden_size / shape.tp
    vocab_unit = shape.vocab_size / shape.tp
    num_layers = shape.num_layers

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
    overhead, per_token, per_document = _fit_linear(plain)
    attention_rows, fixed = _attention_fit(fit)
    if fixed:
        collective_latency_s = statistics.median(fixed.values()) / (shape.num_layers * CP_PASSES)
    activation, output = _memory_factors(fit, shape)
    profile = {
        "gemm_flops": shape.linear_flops_per_token / (shape.tp * per_token),
        "attention_times": attention_rows,
        "microbatch_overhead_s": overhead,
        "document_overhead_s": per_document,
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
        twins = {(m.lengths, m.cp_size): m.seconds for m in plain}
        extras = np.array([m.seconds - twins.get((m.lengths, m.cp_size), cost.microbatch_time(m.lengths, m.cp_size))
                           for m in recomputed])
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
    preset = CostModel(shape, cluster)     # what a run without --dcp-profile plans with
    rows = []
    for m in measurements:
        if not m.held_back:
            continue
        local = local_tokens(m.lengths, m.cp_size)
        predicted_s = cost.microbatch_time(m.lengths, m.cp_size, recompute=m.recompute)
        preset_s = preset.microbatch_time(m.lengths, m.cp_size, recompute=m.recompute)
        predicted_bytes = local * cost.held_bytes_per_local_token(m.recompute)
        preset_bytes = local * preset.held_bytes_per_local_token(m.recompute)
        rows.append({**m.to_json(), "local_tokens": local, "predicted_seconds": predicted_s,
                     "time_rel_error": relative_error(predicted_s, m.seconds),
                     "predicted_saved_bytes": predicted_bytes,
                     "memory_rel_error": relative_error(predicted_bytes, m.saved_bytes),
                     "preset_seconds": preset_s, "preset_time_rel_error": relative_error(preset_s, m.seconds),
                     "preset_memory_rel_error": relative_error(preset_bytes, m.saved_bytes)})
    if not rows:
        raise ValueError("no held-back points to score")

    def median_and_max(key: str) -> tuple[float, float]:
        values = [r[key] for r in rows]
        return statistics.median(values), max(values)

    (median_time, max_time), (median_memory, max_memory) = median_and_max("time_rel_error"), median_and_max(
        "memory_rel_error")
    (preset_time, _), (preset_memory, _) = median_and_max("preset_time_rel_error"), median_and_max(
        "preset_memory_rel_error")
    return {"median_rel_error": median_time, "max_rel_error": max_time,
            "memory_median_rel_error": median_memory, "memory_max_rel_error": max_memory,
            "preset_median_rel_error": preset_time, "preset_memory_median_rel_error": preset_memory,
            "preset": cluster.name, "num_fitted": sum(not m.held_back for m in measurements),
            "num_held_back": len(rows), "points": rows}


def format_report(report: dict) -> str:
    """The held-back table the profiler prints."""
    lines = [f"{'held-back micro-batch':40s} {'measured':>10s} {'predicted':>10s} {'error':>7s} {'preset':>7s}  "
             f"{'saved MiB':>9s} {'predicted':>9s} {'error':>7s}"]
    for r in report["points"]:
        lengths = r["lengths"]
        name = (f"{lengths[0]} tok" if len(lengths) == 1 else f"{len(lengths)} docs/{sum(lengths)} tok") + \
               f" cp{r['cp_size']} {r['recompute']}"
        lines.append(f"{name:40s} {r['seconds'] * 1e3:8.1f}ms {r['predicted_seconds'] * 1e3:8.1f}ms "
                     f"{r['time_rel_error']:6.1%} {r['preset_time_rel_error']:7.1%}  {r['saved_bytes'] / 2**20:9.2f} "
                     f"{r['predicted_saved_bytes'] / 2**20:9.2f} {r['memory_rel_error']:6.1%}")
    lines.append(f"time: median error {report['median_rel_error']:.1%}, worst {report['max_rel_error']:.1%}; "
                 f"activation memory: median {report['memory_median_rel_error']:.1%}, worst "
                 f"{report['memory_max_rel_error']:.1%} ({report['num_held_back']} held-back points, "
                 f"{report['num_fitted']} fitted); the {report['preset']} preset without a profile: median "
                 f"{report['preset_median_rel_error']:.1%} (time), {report['preset_memory_median_rel_error']:.1%} "
                 "(memory)")
    return "\n".join(lines)
