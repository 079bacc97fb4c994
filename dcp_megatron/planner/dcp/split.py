"""A large domain planned in parts: the batch split over node-aligned parts of the domain, each part planned alone.

dcp's search costs time linear in the batch's documents, and every rank of a domain plans the whole batch; at
thousands of ranks a plan takes longer than the step it hides behind (docs/simulator.md). Split planning cuts the
domain into `num_parts` contiguous parts of `part_ranks` ranks (whole nodes) and the batch into as many shares:
- shares: documents longest-work first, each to the share with the least work so far (LPT over each document's
  least rank-seconds, the lower bound's balanced term, bounds.py), ties by sample id; every rank computes it alike;
- parts: each share is planned by dcp's search (own layout and seeds) on a cost model of `part_ranks` ranks whose
  static memory counts the whole domain (state sharded over it, its communicators: ClusterSpec.whole_domain_size);
  its search seeds the baselines at the part's size, so dcp never loses to a baseline on any part;
- the plan: the parts' waves side by side (a part with fewer waves idles in the others' last ones; no group spans
  two parts, so the step is the slowest part's).
Each part's plan depends only on its share and the part's cost model, so a rank may plan its own part only and
gather the others' (core/split_planning.py): the same bytes as planning every part in one process.

Parts grow (x2) while the batch's longest document, alone on a part, would end over 1% after both the batch's lower
bound and its own fastest time on the domain's groups: a part does not make it the step's limit where the whole
domain would not. A batch is planned whole
when `part_ranks` is 0 (off), the domain is not a multiple of it or it is not whole nodes, parts would have to
grow past half the domain, or the run is lockstep (PP > 1, EP > 1, ZeRO-3: every rank of the domain runs the same
micro-batch count).
"""
from __future__ import annotations

import math

import numpy as np

from dcp_megatron.planner.bounds import alone_times, least_rank_seconds
from dcp_megatron.planner.layout import candidate_sizes
from dcp_megatron.planner.list_scheduling import lpt_assign
from dcp_megatron.planner.plan import Group, StepPlan, Wave

# Documents dealt by exact LPT per part before the rest is dealt in snake rows (assign_shares).
HEAD_ROWS = 64
# A part's longest document may end this much after the batch's lower bound, and after its fastest time on the whole
# domain, before parts grow (split_parts): past ~1,000 ranks a long document's time is flat in its group size
# (a 1.2M-token document on h200: 9.51 s on 1,024 ranks, 9.48 s on 2,048, 9.49-9.55 s on 4,096-16,384).
LONGEST_SLACK = 0.01


def split_parts(lengths: np.ndarray, cost, part_ranks: int, bound: float) -> int:
    """The ranks per part this batch is planned in (0: whole; module docstring): `part_ranks`, doubled while the
    longest document alone on a part would end more than LONGEST_SLACK after both the batch's lower bound `bound`
    and the document's own fastest time on any group of the domain."""
    cluster, model = cost.cluster, cost.model
    D = cluster.domain_size
    if part_ranks <= 0 or D % part_ranks or part_ranks % cluster.gpus_per_node or model.lockstep:
        return 0
    alone = alone_times(int(lengths.max()), candidate_sizes(cost.cluster), cost)   # dcp's group sizes
    limit = max(bound, min(alone.values())) * (1.0 + LONGEST_SLACK)
    while 2 * part_ranks <= D:
        if min((t for size, t in alone.items() if size <= part_ranks), default=math.inf) <= limit:
            return part_ranks
        part_ranks *= 2
    return 0


def part_cost(cost, part_ranks: int):
    """The cost model of one part: `part_ranks` ranks, static memory of the whole domain."""
    whole = cost.cluster.sharding_domain_size
    return cost.memoised(("split_part", part_ranks), lambda: cost.with_cluster(domain_size=part_ranks,
                                                                              whole_domain_size=whole))


def assign_shares(ids: np.ndarray, lengths: np.ndarray, cost, num_parts: int) -> np.ndarray:
    """The part of every document: least rank-seconds, longest work first (ties by sample id); the first
    `HEAD_ROWS` x parts documents by LPT, the rest dealt in snake rows over the parts, least loaded first (each row
    adds at most its largest document's work to any part's lead, far less than a head document's)."""
    work = least_rank_seconds(lengths, cost)
    order = np.lexsort((ids, -work))
    head = min(order.size, HEAD_ROWS * num_parts)
    where = np.empty(order.size, dtype=np.int64)
    where[:head], loads = lpt_assign(work[order[:head]].tolist(), [0.0] * num_parts)
    tail = np.arange(order.size - head)
    column = tail % num_parts
    snake = np.where((tail // num_parts) % 2 == 0, column, num_parts - 1 - column)
    where[head:] = np.argsort(np.asarray(loads), kind="stable")[snake]
    part_of = np.empty(lengths.size, dtype=np.int64)
    part_of[order] = where
    return part_of


def share_of(part_of: np.ndarray, part: int) -> np.ndarray:
    """Indices (batch order) of the documents of `part`."""
    return np.flatnonzero(part_of == part)


def compose(part_plans: list[StepPlan], cost, bound: float) -> StepPlan:
    """One plan of the whole domain: part p's groups shifted by p x part ranks; idle singletons where a part has
    fewer waves than the others."""
    part_ranks = part_plans[0].domain_size
    num_waves = max(len(p.waves) for p in part_plans)
    waves = []
    for w in range(num_waves):
        groups: list[Group] = []
        for p, plan in enumerate(part_plans):
            offset = p * part_ranks
            if w < len(plan.waves):
                groups.extend(Group(g.first_rank + offset, g.size, g.microbatches) for g in plan.waves[w].groups)
            else:
                groups.extend(Group(offset + r, 1, ()) for r in range(part_ranks))
        waves.append(Wave(tuple(groups)))
    seeded = sorted({p.extra.get("seeded_from") or p.extra.get("fallback") or "own" for p in part_plans})
    return StepPlan(domain_size=cost.cluster.domain_size, waves=tuple(waves),
                    est_step_time_s=max(p.est_step_time_s for p in part_plans), lower_bound_s=bound, policy="dcp",
                    extra={"split": {"parts": len(part_plans), "part_ranks": part_ranks, "layouts": seeded}})
