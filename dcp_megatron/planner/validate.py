"""Checks every invariant of a plan; the runtime relies on them (docs/design.md, the plan format)."""
from __future__ import annotations

from collections import Counter
from typing import Sequence

from dcp_megatron.planner.costmodel import ClusterSpec
from dcp_megatron.planner.plan import StepPlan


class PlanError(ValueError):
    """A plan breaks an invariant; the message names it."""


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def validate(plan: StepPlan, batch: Sequence[tuple[int, int]], cluster: ClusterSpec, cost) -> None:
    """Raise PlanError naming the first broken invariant; return None if the plan is sound.

    Invariants: the plan's domain is the cluster's; each wave's groups partition [0, D) into
    contiguous blocks in rank order; power-of-two groups are aligned to their size; no group
    exceeds the CP size limit; every sequence of the batch appears exactly once (no extras,
    same length); every micro-batch fits the memory budget under its recompute policy and
    full recompute names at most the layers of one pipeline stage; with PP > 1 every group
    runs exactly one micro-batch per wave; under ZeRO-3 every micro-batch of a wave, fillers included,
    runs the same relief."""
    D = cluster.domain_size
    if plan.domain_size != D:
        raise PlanError(f"domain size: plan has {plan.domain_size} ranks, the cluster {D}")
    if not plan.waves:
        raise PlanError("waves: a plan needs at least one wave")
    pp = cost.model.pp
    layers = cost.layers_per_stage
    budget = cluster.mem_budget_bytes
    limit = cluster.cp_size_limit
    allowed = getattr(cost, "allowed_recompute", None)
    flavours = getattr(cost, "cp_attention", ("allgather",))
    seen: Counter = Counter()
    for w, wave in enumerate(plan.waves):
        next_rank = 0
        for g in wave.groups:
            where = f"wave {w}, group at rank {g.first_rank} size {g.size}"
            if g.size <= 0:
                raise PlanError(f"group size: {where} has a non-positive size")
            if g.first_rank != next_rank:
                raise PlanError(f"partition: {where} should start at rank {next_rank} (groups must tile "
                                f"[0, {D}) contiguously in rank order)")
            next_rank += g.size
            if next_rank > D:
                raise PlanError(f"partition: {where} runs past the domain end {D}")
            if g.size > limit:
                raise PlanError(f"CP size limit: {where} exceeds cp_size_limit {limit}")
            if _is_power_of_two(g.size) and g.first_rank % g.size:
                raise PlanError(f"alignment: {where} is a power of two but not aligned to its size")
            if cost.model.lockstep and len(g.microbatches) != 1:
                raise PlanError(f"pipeline: {where} runs {len(g.microbatches)} micro-batches; with pp={pp}, "
                                f"ep={cost.model.ep} "
                                f"every group runs exactly one per wave")
            for i, mb in enumerate(g.microbatches):
                rc = mb.recompute
                if mb.sequences and allowed is not None and not _allowed(cost, rc):   # idle: runs nothing
                    raise PlanError(f"recompute: {where} micro-batch {i} uses {rc}, the cost model allows "
                                    f"only {list(allowed)}")
                if mb.attention not in flavours or (mb.attention != "allgather" and g.size == 1):
                    raise PlanError(f"cp attention: {where} micro-batch {i} uses {mb.attention!r}, allowed "
                                    f"{list(flavours)} (and only on a CP group of 2 or more)")
                if rc.kind == "full" and rc.full_layers > layers:
                    raise PlanError(f"recompute: {where} micro-batch {i} recomputes {rc.full_layers} layers, "
                                    f"a pipeline stage has {layers}")
                for seq in mb.sequences:
                    seen[(int(seq[0]), int(seq[1]))] += 1
                if mb.sequences:
                    mem = cost.microbatch_memory(mb.lengths, g.size, recompute=rc)
                    if mem > budget:
                        raise PlanError(f"memory: {where} micro-batch {i} needs {mem} bytes per rank "
                                        f"(recompute {rc}), budget {budget}")
        if next_rank != D:
            raise PlanError(f"partition: wave {w} covers ranks [0, {next_rank}) of [0, {D})")
        if cost.model.wave_uniform_relief:
            reliefs = sorted({str(mb.recompute) for g in wave.groups for mb in g.microbatches})
            if len(reliefs) > 1:   # idle fillers too: they run the wave's layers like everyone else
                raise PlanError(f"relief: wave {w} mixes {reliefs}; under ZeRO-3 every micro-batch of a wave, "
                                f"idle fillers included, runs one relief (the weight gathers pair up across ranks)")
    expected = Counter((int(s), int(n)) for s, n in batch)
    if seen != expected:
        missing = sorted((expected - seen).elements())[:3]
        extra = sorted((seen - expected).elements())[:3]
        raise PlanError(f"sequences: each sequence of the batch must appear exactly once; "
                        f"missing {missing}, unexpected or repeated {extra}")


def _allowed(cost, recompute) -> bool:
    """The cost model's menu check (costmodel/relief.py); a duck-typed cost model without one checks the kind."""
    check = getattr(cost, "allows", None)
    return check(recompute) if check is not None else recompute.kind in cost.allowed_recompute
