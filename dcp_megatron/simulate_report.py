"""The simulator's metrics: per-step records of each policy, aggregated into one report.

Per policy (all step times from the same cost model, on the same batches):
  mean_step_s       mean step time over the steps.
  tokens_per_s      total tokens / total step time.
  speedup_vs_static Σ static step time / Σ this policy's step time (ratio of sums; 1.0 for
                    static itself; null when static was not run).
  speedup_vs_best_baseline
                    Σ over steps of the fastest OTHER baseline's time on that step
                    / Σ this policy's step time. Baselines are the selected policies other
                    than "dcp"; "other" excludes the policy itself, so for dcp it is the
                    per-step best of all baselines, and for a baseline it is the per-step best
                    of the remaining ones (< 1 means some other baseline is faster). Null when
                    no other baseline was run.
  min_step_speedup_vs_best_baseline
                    the same ratio on the worst single step (min over steps).
  lb_ratio_p50/p95  step time / lower bound of that batch, median and 95th percentile.
  peak_mem_frac     largest per-rank micro-batch memory estimate / GPU memory (not the budget).
  plan_ms_p50/p99   wall time of make_plan in milliseconds (on the machine that ran the simulation).
  cp_size_hist      CP size -> number of sequences run at that size, over all steps.
  plan_origins      dcp only (planner/plan_origin.py): per origin (own: dcp's own layout; seeded: a baseline's
                    layout with dcp's reliefs; fallback: a baseline's plan as is), its steps, its share of dcp's
                    total step time, its share of dcp's lead over the per-step best baseline (Σ over its steps of
                    best baseline - dcp, / the same Σ over all steps; null when no other baseline ran or there is
                    no lead), and how many steps each baseline layout gave (`sources`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from dcp_megatron.planner.plan_origin import ORIGINS, plan_origin

DCP_POLICY = "dcp"


@dataclass
class PolicyRun:
    """What one policy did on every step of a simulation."""

    name: str
    mem_bytes_per_gpu: int
    step_time_s: list[float] = field(default_factory=list)
    lower_bound_s: list[float] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    plan_s: list[float] = field(default_factory=list)
    peak_mem_bytes: int = 0
    cp_size_hist: dict[int, int] = field(default_factory=dict)
    origins: list[tuple[str, str | None]] = field(default_factory=list)   # per step: plan_origin(plan)

    def add_step(self, *, step_time_s: float, lower_bound_s: float, num_tokens: int, plan_s: float, plan) -> None:
        self.step_time_s.append(step_time_s)
        self.lower_bound_s.append(lower_bound_s)
        self.num_tokens.append(num_tokens)
        self.plan_s.append(plan_s)
        for wave in plan.waves:
            for group in wave.groups:
                for mb in group.microbatches:
                    self.peak_mem_bytes = max(self.peak_mem_bytes, mb.est_mem_bytes)
        self.origins.append(plan_origin(plan))
        for size, count in plan.cp_size_histogram().items():
            self.cp_size_hist[size] = self.cp_size_hist.get(size, 0) + count


def _ratio_of_sums(reference: np.ndarray, times: np.ndarray) -> float:
    return float(reference.sum() / times.sum())


def summarize(runs: dict[str, PolicyRun]) -> dict[str, dict]:
    """policy name -> metrics (see the module docstring)."""
    times = {name: np.asarray(run.step_time_s, dtype=np.float64) for name, run in runs.items()}
    baselines = [name for name in runs if name != DCP_POLICY]
    report = {}
    for name, run in runs.items():
        t = times[name]
        others = [b for b in baselines if b != name]
        best_other = np.min([times[b] for b in others], axis=0) if others else None
        lb_ratio = t / np.asarray(run.lower_bound_s, dtype=np.float64)
        plan_ms = 1e3 * np.asarray(run.plan_s, dtype=np.float64)
        report[name] = {
            "mean_step_s": float(t.mean()),
            "tokens_per_s": float(sum(run.num_tokens) / t.sum()),
            "speedup_vs_static": _ratio_of_sums(times["static"], t) if "static" in times else None,
            "speedup_vs_best_baseline": _ratio_of_sums(best_other, t) if others else None,
            "min_step_speedup_vs_best_baseline": float(np.min(best_other / t)) if others else None,
            "lb_ratio_p50": float(np.percentile(lb_ratio, 50)),
            "lb_ratio_p95": float(np.percentile(lb_ratio, 95)),
            "peak_mem_frac": run.peak_mem_bytes / run.mem_bytes_per_gpu,
            "plan_ms_p50": float(np.percentile(plan_ms, 50)),
            "plan_ms_p99": float(np.percentile(plan_ms, 99)),
            "cp_size_hist": {str(size): count for size, count in sorted(run.cp_size_hist.items())},
        }
        if name == DCP_POLICY:
            report[name]["plan_origins"] = _origins(run, t, best_other)
    return report


def _origins(run: PolicyRun, times: np.ndarray, best_other: np.ndarray | None) -> dict[str, dict]:
    """dcp's steps per plan origin: steps, share of time, share of the lead (module docstring), sources."""
    origin = np.array([o for o, _ in run.origins])
    lead = None if best_other is None else best_other - times
    out = {}
    for kind in ORIGINS:
        mine = origin == kind
        sources: dict[str, int] = {}
        for (o, source) in run.origins:
            if o == kind and source is not None:
                sources[source] = sources.get(source, 0) + 1
        out[kind] = {"steps": int(mine.sum()), "time_share": float(times[mine].sum() / times.sum()),
                     "lead_share": float(lead[mine].sum() / lead.sum()) if lead is not None and lead.sum() > 0
                     else None, "sources": dict(sorted(sources.items()))}
    return out


def format_origins(report: dict[str, dict]) -> str:
    """A line under the table (newline first; empty without dcp): how many of dcp's steps were its own layout,
    seeded from a baseline's, or a baseline's plan, and their shares of its time and of its lead."""
    if "plan_origins" not in report.get(DCP_POLICY, {}):
        return ""
    origins = report[DCP_POLICY]["plan_origins"]
    parts = []
    for kind, o in origins.items():
        lead = f", {o['lead_share']:.0%} of its lead" if o["lead_share"] is not None else ""
        seeds: dict[str, int] = {}   # ZeRO-3's seeds, one per token cap, counted together (exact in the JSON)
        for source, n in o["sources"].items():
            name = re.sub(r"@cap\d+$", "@cap*", source)
            seeds[name] = seeds.get(name, 0) + n
        sources = "; " + ", ".join(f"{s} x{n}" for s, n in seeds.items()) if seeds else ""
        parts.append(f"{kind} {o['steps']} ({o['time_share']:.0%} of its time{lead}{sources})")
    total = sum(o["steps"] for o in origins.values())
    return f"\ndcp's plans over {total} steps: " + ", ".join(parts)


_COLUMNS = (  # (header, key, format)
    ("step_s", "mean_step_s", "{:.3f}"),
    ("ktok/s", "tokens_per_s", None),
    ("vs_static", "speedup_vs_static", "{:.2f}x"),
    ("vs_best_base", "speedup_vs_best_baseline", "{:.2f}x"),
    ("worst_step", "min_step_speedup_vs_best_baseline", "{:.2f}x"),
    ("lb_p50", "lb_ratio_p50", "{:.3f}"),
    ("lb_p95", "lb_ratio_p95", "{:.3f}"),
    ("mem", "peak_mem_frac", "{:.0%}"),
    ("plan_ms_p50", "plan_ms_p50", "{:.1f}"),
    ("plan_ms_p99", "plan_ms_p99", "{:.1f}"),
)


def format_table(report: dict[str, dict]) -> str:
    """A fixed-width text table, one row per policy (markdown-compatible)."""
    header = ["policy"] + [h for h, _, _ in _COLUMNS]
    rows = []
    for name, metrics in report.items():
        row = [name]
        for _, key, fmt in _COLUMNS:
            value = metrics[key]
            if value is None:
                row.append("-")
            elif key == "tokens_per_s":
                row.append(f"{value / 1e3:.1f}")
            else:
                row.append(fmt.format(value))
        rows.append(row)
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(header, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    return "\n".join(lines)
