"""dcp under ZeRO-3: dev's dynamic-CP layout at the token caps of a few wave counts, each wave with its own relief.

In lockstep every wave pays the stage's weight gathers, so a step is about Σ over waves of max(the wave's
slowest micro-batch, the gathers it cannot hide): few, full waves win, with the relief that lets them hold
that many tokens. A tuned megatron-dynamic finds one such run-wide token cap and recompute over a run's
batches (planner/baselines/sweep.py); dcp cannot see the tuning, so per batch it schedules dev's packing at
the cap of each wave count n (Σ local tokens / (D·n), CAP_SLACK over), from the fewest waves the strongest
relief allows to those the room without relief needs, and gives every wave the relief that holds its fullest
micro-batch fastest (relief_pass.with_wave_reliefs: one relief per wave, fillers included, which DeepSpeed's
ZeRO-3 can run); then the caps of a tuned run's grid (settings.token_caps) next to the best cap, where
the tuned peer's setting lies when it is near this batch's best. A seed that beats dcp's plan is taken
(`extra["seeded_from"]`). Schedules take ~0.05 s each at D = 64 and are scored on arrays (plan objects only
for a seed that wins); wave counts are tried from the most down,
stopping SEED_PATIENCE counts after the seeds stopped getting faster.
"""
from __future__ import annotations

import math

import numpy as np

from dcp_megatron.planner.plan import StepPlan
from dcp_megatron.planner.baselines.megatron_dynamic import dynamic_cp_sizes, dynamic_schedule, waves_of_schedule
from dcp_megatron.planner.dcp.relief_pass import wave_relief, with_wave_reliefs
from dcp_megatron.planner.baselines.settings import DynamicSetting, least_recompute_for, token_caps
from dcp_megatron.planner.timeline import one_microbatch_makespan, plan_makespan

CAP_SLACK = 0.02        # a wave count's cap over its even share: dev's greedy fills waves to the cap, unevenly
SEED_PATIENCE = 2       # wave counts tried past the last one whose seed shortened the plan
MOST_SEEDS = 12         # at most this many wave counts per batch (planning time)
NEAR_CAPS = (1.05, 1.15)   # the tuned-style caps tried from best / [0] to best x [1]


def wave_count_caps(lengths: np.ndarray, cost) -> list[int]:
    """Per-rank token caps, one per wave count, most waves first (module docstring)."""
    D = cost.cluster.domain_size
    top = dynamic_cp_sizes(D, cost.cluster.cp_size_limit)[-1]
    local_sum = float(cost.doc_terms(lengths, 1)[0].sum())
    longest_share = 2 * -(-int(lengths.max()) // (2 * top))
    lightest = cost.max_local_tokens(cost.base_recompute)
    strongest = cost.max_local_tokens(cost.strongest_recompute)
    most = max(1, math.ceil(local_sum / (D * lightest)))
    fewest = max(1, math.ceil(local_sum / (D * strongest)))
    caps = []
    for n in range(most, fewest - 1, -1):
        cap = min(int(math.ceil(local_sum / (D * n) * (1 + CAP_SLACK))), strongest)
        if cap >= longest_share and (not caps or cap > caps[-1]):
            caps.append(cap)
    return caps[:MOST_SEEDS]


def lockstep_seeds(ids: np.ndarray, lengths: np.ndarray, cost, must_beat: float, max_seq_len: int):
    """(name, waves) of the seeds that beat `must_beat` seconds, each faster than the one before: the wave counts'
    caps, most waves first, stopping SEED_PATIENCE counts after the seeds stopped getting faster; then the caps
    a tuned run would pick (settings.token_caps) near the best one (NEAR_CAPS)."""
    D = cost.cluster.domain_size
    best, seeds_best, best_cap, misses = must_beat, math.inf, None, 0
    tried = set()

    terms: dict[int, np.ndarray] = {}      # per CP size: each document's (local, compute, attention) terms

    def seed(cap: int):
        """(waves or None, seconds): scored on arrays; plan objects only for a seed that beats `best`."""
        tried.add(cap)
        recompute = least_recompute_for(cost, cap)
        if recompute is None:
            return None, math.inf
        try:
            schedule = dynamic_schedule(lengths, cost, DynamicSetting(token_cap=cap, recompute=recompute))
        except ValueError:           # a sequence this cap cannot hold at any allowed size
            return None, math.inf
        t = _seconds(schedule, lengths, cost, recompute, terms)
        if t >= best * (1 - 1e-9):
            return None, t
        waves, _ = with_wave_reliefs(waves_of_schedule(schedule, ids, lengths, cost, recompute), cost)
        return waves, plan_makespan(StepPlan(domain_size=D, waves=waves))

    for cap in wave_count_caps(lengths, cost):
        waves, t = seed(cap)
        if waves is not None and t < best * (1 - 1e-9):
            best = t
            yield f"megatron-dynamic@cap{cap}", waves
        if t < seeds_best * (1 - 1e-9):
            seeds_best, best_cap, misses = t, cap, 0
        elif math.isfinite(t):
            misses += 1
            if misses > SEED_PATIENCE:
                break
    if best_cap is None:
        return
    top = dynamic_cp_sizes(D, cost.cluster.cp_size_limit)[-1]
    lo, hi = best_cap / NEAR_CAPS[0], best_cap * NEAR_CAPS[1]
    for cap in token_caps(cost, max_seq_len, top):
        if lo <= cap <= hi and cap not in tried:
            waves, t = seed(cap)
            if waves is not None and t < best * (1 - 1e-9):
                best = t
                yield f"megatron-dynamic@cap{cap}", waves


def _seconds(schedule, lengths: np.ndarray, cost, recompute, terms: dict) -> float:
    """The step of dev's schedule with each wave's relief (relief_pass.wave_relief, no micro-batch slower than with
    the run-wide `recompute`), from arrays: what `with_wave_reliefs` and `plan_makespan` give its plan objects."""
    D = cost.cluster.domain_size
    wave_of, first_of, size_of, times = [], [], [], []
    for w, groups in enumerate(schedule):
        sums, firsts, first = [], [], 0
        for size, members in groups:
            if size not in terms:
                terms[size] = np.stack(cost.doc_terms(lengths, size))
            sums.append(terms[size][:, members].sum(axis=1))
            firsts.append(first)
            first += size
        local, compute, attn = np.array(sums).T
        sizes, firsts = np.array([g[0] for g in groups]), np.array(firsts)
        run_wide = cost.times_from_sums(local, compute, attn, sizes, firsts, recompute)
        relief, seconds = wave_relief(cost, local, compute, attn, sizes, firsts, run_wide)
        seconds = run_wide if relief is None else seconds
        idle = list(range(first, D))
        wave_of += [w] * (len(groups) + len(idle))
        first_of += firsts.tolist() + idle
        size_of += sizes.tolist() + [1] * len(idle)
        times += seconds.tolist() + [cost.cluster.microbatch_overhead_s] * len(idle)
    return one_microbatch_makespan(*(np.asarray(x) for x in (wave_of, first_of, size_of, times)), D)
