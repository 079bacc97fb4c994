"""dcp-simulate: what each layout policy is worth on a stream of real-shaped batches.

A document stream (a lengths file, or a built-in distribution drawn with a seed) is cut into
global batches by `GlobalBatcher`, in order. Every selected policy plans every batch; every
plan is validated (a failing plan is an error) and scored by the same cost model: the
simulator re-estimates each micro-batch's time and memory itself and takes the step time
from the per-rank timeline, so no policy grades its own homework. The metrics are defined
in `dcp_megatron.simulate_report`.

Sizes: `--gpus` is the total number of GPUs; the DCP domain (the DP×CP ranks of one TP/PP
coordinate) has gpus / (tp·pp) ranks, and a node holds gpus_per_node / tp of them (TP
stays inside a node). `--zero-stage 3` (ZeRO-3 / FSDP: weights sharded over the domain) makes every policy plan
in lockstep and charges each micro-batch its weight all-gathers and gradient reduce-scatters
(costmodel/param_sharding.py); stages 0-2 change only the static memory. `--ep` (expert parallelism of an MoE preset) carves EP groups of ep consecutive
ranks out of the domain: it must divide the domain (and the model's experts); every policy then plans in
lockstep (one micro-batch per group per wave: the EP all-to-alls pair the ranks' micro-batches) and the cost
model charges the all-to-alls.

`--max-seq-len` (the run's length cap, from which the static layouts are chosen once per
run) defaults to the longest document among those the run's `--steps` batches contain,
capped at `--tokens-per-step`: the cap a user who tuned the static layout for this data
would pick, and the most favourable one for the static baselines.

Baselines are tuned as their users tune them (`dcp_megatron.planner.baselines.sweep`): before the
run is scored, each selected baseline with run-wide knobs (static's CP size and recompute,
megatron-dynamic's per-rank token cap, smallest CP size and recompute, megatron-hybrid's cap and
recompute) gets the single setting with the lowest mean step over the run's batches; the winner is
printed (and the whole grid with `--verbose`; both are in the `--json` report). `--no-tune` plans
them at their defaults instead. `dcp` is never tuned.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Iterable, Sequence

from dcp_megatron.planner.batcher import OVERLONG_MODES, GlobalBatch, GlobalBatcher
from dcp_megatron.planner.costmodel import MENU_NAMES, cluster_preset, model_preset
from dcp_megatron.planner.costmodel.cost_profile import check_allowed_recompute
from dcp_megatron.planner.distributions import iter_builtin_lengths, read_lengths
from dcp_megatron.planner.plan import StepPlan
from dcp_megatron.simulate_report import PolicyRun, format_origins, format_table, summarize

DEFAULT_POLICIES = ("static", "static-balanced", "megatron-hybrid", "megatron-dynamic", "dcp")
BUILTIN_PREFIX = "builtin:"


class PolicyFailure(RuntimeError):
    """A policy raised, or returned a plan that does not validate: a bug, not bad input."""


@dataclass(frozen=True, kw_only=True)
class SimulationConfig:
    lengths: str                      # a file path or "builtin:NAME"
    model: str = "llama3-8b"
    cluster: str = "h200"
    gpus: int = 32
    gpus_per_node: int = 8
    tp: int = 1
    pp: int = 1
    ep: int = 1
    tokens_per_step: int = 4_194_304
    steps: int = 20
    policies: tuple[str, ...] = DEFAULT_POLICIES
    seed: int = 0
    max_seq_len: int | None = None    # None: see the module docstring
    overlong: str = "error"
    profile: str | None = None        # cost-model profile JSON
    recompute: tuple[str, ...] = MENU_NAMES   # the reliefs every policy may use (--dcp-recompute's menu, relief.py)
    tune_baselines: bool = True       # sweep each baseline's run-wide setting over the run's batches
    zero_stage: int | None = None     # None: ZeRO-1 (the distributed optimizer); 3: lockstep, weight gathers

    def __post_init__(self) -> None:
        for name in ("gpus", "gpus_per_node", "tp", "pp", "ep", "tokens_per_step", "steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.gpus % (self.tp * self.pp):
            raise ValueError(f"--gpus {self.gpus} is not divisible by tp*pp = {self.tp}*{self.pp}")
        if self.gpus_per_node % self.tp:
            raise ValueError(f"--gpus-per-node {self.gpus_per_node} is not divisible by --tp {self.tp} "
                             f"(tensor parallelism stays inside a node)")
        if self.domain_size % self.ep:
            raise ValueError(f"--ep {self.ep} does not divide the domain of {self.domain_size} ranks "
                             f"(--gpus / (tp*pp)): EP groups are carved out of the DP x CP ranks")
        if self.seed < 0:
            raise ValueError(f"--seed must be >= 0, got {self.seed}")
        if self.max_seq_len is not None and not 0 < self.max_seq_len <= self.tokens_per_step:
            raise ValueError(f"--max-seq-len must be in [1, --tokens-per-step={self.tokens_per_step}], "
                             f"got {self.max_seq_len}")
        if self.overlong not in OVERLONG_MODES:
            raise ValueError(f"--overlong must be one of {OVERLONG_MODES}, got {self.overlong!r}")
        if not self.policies:
            raise ValueError("--policies is empty")
        if len(set(self.policies)) != len(self.policies):
            raise ValueError(f"--policies lists a policy twice: {','.join(self.policies)}")
        try:
            check_allowed_recompute(self.recompute)
        except ValueError as err:
            raise ValueError(f"--recompute: {err}") from None
        if not self.lengths:
            raise ValueError("--lengths is empty; give a file or builtin:NAME")
        if self.zero_stage is not None and self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"--zero-stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if not isinstance(self.tune_baselines, bool):
            raise ValueError(f"tune_baselines must be a bool, got {self.tune_baselines!r}")

    @property
    def domain_size(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def domain_ranks_per_node(self) -> int:
        return self.gpus_per_node // self.tp


@dataclass
class SimulationResult:
    config: SimulationConfig
    max_seq_len: int
    batches: list[GlobalBatch]
    runs: dict[str, PolicyRun]
    sweeps: dict = dataclasses.field(default_factory=dict)   # baseline -> SweepResult (tuned runs)

    def to_json(self) -> dict:
        config = dataclasses.asdict(self.config)
        config.update(policies=list(self.config.policies), domain_size=self.config.domain_size,
                      max_seq_len=self.max_seq_len, num_batches=len(self.batches))
        return {"config": config, "policies": summarize(self.runs),
                "settings": {name: result.to_json() for name, result in self.sweeps.items()}}


def documents(lengths: str, seed: int) -> Iterable[tuple[int, int]]:
    """(document_id, length) in stream order; document ids are stream positions."""
    if lengths.startswith(BUILTIN_PREFIX):
        return enumerate(iter_builtin_lengths(lengths[len(BUILTIN_PREFIX):], seed))
    return list(enumerate(read_lengths(lengths)))


def _take_batches(config: SimulationConfig, max_seq_len: int) -> list[GlobalBatch]:
    batcher = GlobalBatcher(tokens_per_step=config.tokens_per_step, max_seq_len=max_seq_len,
                            overlong=config.overlong)
    try:
        return list(itertools.islice(batcher.batches(documents(config.lengths, config.seed)), config.steps))
    except ValueError as err:
        if "opt in to overlong" in str(err):
            raise ValueError(f"{err} (dcp-simulate: --overlong split|truncate, or a larger "
                             f"--max-seq-len / --tokens-per-step)") from None
        raise


def cut_batches(config: SimulationConfig) -> tuple[list[GlobalBatch], int]:
    """The run's global batches and its length cap (see the module docstring)."""
    if config.max_seq_len is not None:
        return _take_batches(config, config.max_seq_len), config.max_seq_len
    batches = _take_batches(config, config.tokens_per_step)
    if not batches:
        raise ValueError(f"--lengths {config.lengths} holds no documents")
    # No document exceeded max(batch lengths), so cutting again with it gives the same batches.
    return batches, max(b.max_length for b in batches)


def simulate(config: SimulationConfig, *, dump_dir: str | None = None,
             keep_step: int | None = None) -> tuple[SimulationResult, dict[str, StepPlan]]:
    """Plan, validate and score every batch with every policy.

    Returns the result and, when `keep_step` is given, each policy's (re-scored) plan of
    that step (for drawing)."""
    from dcp_megatron.planner.bounds import lower_bound
    from dcp_megatron.planner.costmodel import CostModel, load_profile
    from dcp_megatron.planner.policies import POLICIES, make_plan
    from dcp_megatron.planner.rescore import rescored
    from dcp_megatron.planner.timeline import plan_makespan
    from dcp_megatron.planner.validate import PlanError, validate

    unknown = [p for p in config.policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policy {unknown[0]!r} in --policies; choose from {', '.join(POLICIES)}")
    model = dataclasses.replace(model_preset(config.model, tp=config.tp, pp=config.pp, ep=config.ep),
                                zero_stage=config.zero_stage)
    cluster = cluster_preset(config.cluster, domain_size=config.domain_size,
                             gpus_per_node=config.domain_ranks_per_node)
    profile = load_profile(config.profile) if config.profile else None
    cost = CostModel(model, cluster, profile=profile, allowed_recompute=config.recompute)
    batches, max_seq_len = cut_batches(config)
    if len(batches) < config.steps:
        print(f"dcp-simulate: note: the data holds only {len(batches)} of the {config.steps} steps asked for",
              file=sys.stderr)
    runs = {name: PolicyRun(name=name, mem_bytes_per_gpu=cluster.mem_bytes_per_gpu) for name in config.policies}
    sweeps = {}
    if config.tune_baselines:
        from dcp_megatron.planner.baselines.sweep import SWEPT_POLICIES, sweep
        for name in (p for p in config.policies if p in SWEPT_POLICIES):
            try:
                sweeps[name] = sweep(name, [b.sequences for b in batches], cost, max_seq_len=max_seq_len)
            except ValueError as err:
                raise PolicyFailure(f"tuning policy {name!r} failed: {err}") from err
    kept: dict[str, StepPlan] = {}
    tuned = {name: result.winner for name, result in sweeps.items()}
    for batch in batches:
        bound = lower_bound(batch.sequences, cost)
        for name in config.policies:
            started = time.perf_counter()
            try:
                plan = make_plan(name, batch.sequences, cost, max_seq_len=max_seq_len,   # dcp seeds from the tuned too
                                 setting=tuned.get(name),
                                 **({"baseline_settings": tuned} if name == "dcp" else {}))
            except ValueError as err:
                raise PolicyFailure(f"policy {name!r} failed on step {batch.step}: {err}") from err
            plan_s = time.perf_counter() - started
            try:
                validate(plan, batch.sequences, cluster, cost)
            except PlanError as err:
                raise PolicyFailure(f"policy {name!r} produced an invalid plan for step {batch.step}: {err}") from err
            if dump_dir is not None:
                os.makedirs(os.path.join(dump_dir, name), exist_ok=True)
                with open(os.path.join(dump_dir, name, f"step_{batch.step}.json"), "w") as f:
                    f.write(plan.dumps())
            scored = rescored(plan, cost)
            runs[name].add_step(step_time_s=plan_makespan(scored), lower_bound_s=bound,
                                num_tokens=batch.num_tokens, plan_s=plan_s, plan=scored)
            if batch.step == keep_step:
                kept[name] = dataclasses.replace(scored, est_step_time_s=plan_makespan(scored), lower_bound_s=bound)
    return SimulationResult(config=config, max_seq_len=max_seq_len, batches=batches, runs=runs, sweeps=sweeps), kept


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dcp-simulate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = SimulationConfig(lengths="-")
    p.add_argument("--lengths", required=True, help="lengths file (one positive integer per line) or builtin:NAME "
                   "with NAME in wikipedia, prolong, lognormal, bytescale")
    p.add_argument("--model", default=d.model, help="model preset")
    p.add_argument("--cluster", default=d.cluster, help="cluster preset")
    p.add_argument("--gpus", type=int, default=d.gpus, help="total GPUs (domain = gpus / (tp*pp))")
    p.add_argument("--gpus-per-node", type=int, default=d.gpus_per_node)
    p.add_argument("--tp", type=int, default=d.tp)
    p.add_argument("--pp", type=int, default=d.pp)
    p.add_argument("--ep", type=int, default=d.ep, help="expert parallelism (an MoE model preset; divides the domain)")
    p.add_argument("--tokens-per-step", type=int, default=d.tokens_per_step, help="global batch token budget")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--policies", default=",".join(d.policies), help="comma-separated policy names")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the built-in distribution")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="the run's length cap (default: longest document in the run, capped at tokens-per-step)")
    p.add_argument("--overlong", default=d.overlong, choices=OVERLONG_MODES,
                   help="what to do with documents longer than --max-seq-len")
    p.add_argument("--recompute", default=",".join(d.recompute),
                   help="comma list of the recompute kinds policies may use (a run's --dcp-recompute; under EP > 1 "
                   "--dcp takes out full)")
    p.add_argument("--profile", default=None, help="cost-model profile JSON (overrides the preset's constants)")
    p.add_argument("--zero-stage", type=int, default=None, choices=(0, 1, 2, 3),
                   help="ZeRO stage over the domain (default: 1, the distributed optimizer); 3 shards the weights: "
                   "every policy plans in lockstep and pays the per-micro-batch weight gathers")
    p.add_argument("--no-tune", action="store_true",
                   help="plan the baselines at their default settings instead of sweeping each one's run-wide "
                   "setting over the run's batches (dcp_megatron/planner/baselines/sweep.py)")
    p.add_argument("--verbose", action="store_true",
                   help="print every point of each baseline's sweep, not only its winner")
    p.add_argument("--json", default=None, metavar="OUT", help="write the metrics as JSON")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="draw one step's per-rank timelines")
    p.add_argument("--plot-step", type=int, default=0, help="which step --plot draws")
    p.add_argument("--dump-plans", default=None, metavar="DIR", help="write DIR/<policy>/step_<k>.json")
    return p


def config_from_args(args: argparse.Namespace) -> SimulationConfig:
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    return SimulationConfig(lengths=args.lengths, model=args.model, cluster=args.cluster, gpus=args.gpus,
                            gpus_per_node=args.gpus_per_node, tp=args.tp, pp=args.pp, ep=args.ep,
                            tokens_per_step=args.tokens_per_step, steps=args.steps, policies=policies,
                            seed=args.seed, max_seq_len=args.max_seq_len, overlong=args.overlong,
                            profile=args.profile, zero_stage=args.zero_stage, tune_baselines=not args.no_tune,
                            recompute=tuple(k.strip() for k in args.recompute.split(",") if k.strip()))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
        if args.plot and not 0 <= args.plot_step < config.steps:
            raise ValueError(f"--plot-step must be in [0, --steps={config.steps}), got {args.plot_step}")
        result, kept = simulate(config, dump_dir=args.dump_plans, keep_step=args.plot_step if args.plot else None)
    except ValueError as err:
        print(f"dcp-simulate: error: {err}", file=sys.stderr)
        return 2
    except PolicyFailure as err:
        print(f"dcp-simulate: error: {err}", file=sys.stderr)
        return 1
    report = result.to_json()
    from dcp_megatron.planner.baselines.sweep import format_sweep
    for sweep_result in result.sweeps.values():   # the winners; the grids (hundreds of lines) with --verbose
        print(format_sweep(sweep_result, grid=args.verbose))
    print(f"{config.lengths}: {len(result.batches)} steps of <= {config.tokens_per_step} tokens, "
          f"max_seq_len={result.max_seq_len}, {config.model} on {config.gpus}x{config.cluster} "
          f"(tp={config.tp} pp={config.pp} ep={config.ep}, domain {config.domain_size}"
          f"{'' if config.zero_stage is None else f', ZeRO-{config.zero_stage}'})")
    print(format_table(report["policies"]) + format_origins(report["policies"]))   # dcp's own layouts vs a baseline's
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, sort_keys=True)
            f.write("\n")
    if args.plot:
        if not kept:
            print(f"dcp-simulate: error: step {args.plot_step} was not simulated", file=sys.stderr)
            return 2
        from dcp_megatron.plotting import draw_step_timelines
        draw_step_timelines(kept, args.plot, title=f"{config.lengths}, step {args.plot_step}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
