"""Measured per-step timings of every rank, next to what the plan predicted.

Each rank records where its step time went: computing its micro-batches (forward + backward,
CP communication inside them included), waiting at the start of each wave for the other members
of its new group (the first collective of the group, a 1-element all-reduce, blocks until the
slowest member arrives), and the deferred gradient reduction at the end (which also absorbs the
wait for the slowest rank of the domain). The reference engine all-gathers these over the domain so that
every rank holds the whole picture and can print it.

Imbalance is (max - mean) / max of the ranks' compute times: 0 when every rank computes equally
long, approaching 1 when one rank does all the work. The prediction uses the same formula on
the plan's estimated per-rank busy time (sum of est_time_s of the rank's micro-batches).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist


def imbalance(values: Sequence[float]) -> float:
    """(max - mean) / max; 0 for an empty or all-zero sequence."""
    if not values or max(values) <= 0:
        return 0.0
    top = max(values)
    return (top - sum(values) / len(values)) / top


def predicted_busy_s(plan) -> list[float]:
    """Per domain rank: the plan's estimated time of the micro-batches that rank runs."""
    return [sum(g.est_time_s for _, g in plan.rank_schedule(rank)) for rank in range(plan.domain_size)]


@dataclass(frozen=True, kw_only=True)
class RankTimes:
    """What one rank measured in one step (seconds)."""

    domain_rank: int
    num_microbatches: int
    compute_s: float                 # inside its micro-batches: forward, backward, CP collectives
    wave_wait_s: tuple[float, ...]   # per wave: blocked on the first collective of that wave's group
    reduce_s: float                  # deferred gradient reduction, incl. waiting for the slowest rank
    step_s: float                    # wall time from the step's start to the end of the reduction

    @property
    def wait_s(self) -> float:
        return sum(self.wave_wait_s)

    def to_tensor(self) -> torch.Tensor:
        head = [self.domain_rank, self.num_microbatches, self.compute_s, self.reduce_s, self.step_s]
        return torch.tensor(head + list(self.wave_wait_s), dtype=torch.float64)

    @staticmethod
    def from_tensor(values: torch.Tensor) -> "RankTimes":
        v = values.tolist()
        return RankTimes(domain_rank=int(v[0]), num_microbatches=int(v[1]), compute_s=v[2], reduce_s=v[3],
                         step_s=v[4], wave_wait_s=tuple(v[5:]))


@dataclass(frozen=True, kw_only=True)
class StepStats:
    """All ranks' timings of one step and the plan's prediction."""

    ranks: tuple[RankTimes, ...]
    predicted_busy_s: tuple[float, ...]
    predicted_step_s: float
    policy: str = ""

    @property
    def step_s(self) -> float:
        return max(r.step_s for r in self.ranks)

    @property
    def compute_s(self) -> tuple[float, ...]:
        return tuple(r.compute_s for r in self.ranks)

    @property
    def imbalance(self) -> float:
        return imbalance(self.compute_s)

    @property
    def predicted_imbalance(self) -> float:
        return imbalance(self.predicted_busy_s)

    def wave_wait_s(self, wave_index: int) -> tuple[float, ...]:
        """Every rank's wait at the start of one wave."""
        return tuple(r.wave_wait_s[wave_index] for r in self.ranks)

    def to_json(self) -> dict:
        return {
            "policy": self.policy,
            "step_s": self.step_s,
            "predicted_step_s": self.predicted_step_s,
            "imbalance": self.imbalance,
            "predicted_imbalance": self.predicted_imbalance,
            "ranks": [{"domain_rank": r.domain_rank, "num_microbatches": r.num_microbatches,
                       "compute_s": r.compute_s, "wave_wait_s": list(r.wave_wait_s), "reduce_s": r.reduce_s,
                       "step_s": r.step_s, "predicted_busy_s": p}
                      for r, p in zip(self.ranks, self.predicted_busy_s)],
        }

    def summary(self) -> str:
        lines = [f"{self.policy or 'step'}: measured {self.step_s * 1e3:.1f} ms (plan {self.predicted_step_s * 1e3:.1f} ms),"
                 f" imbalance {self.imbalance:.3f} (plan {self.predicted_imbalance:.3f})"]
        for r, p in zip(self.ranks, self.predicted_busy_s):
            lines.append(f"  rank {r.domain_rank}: mb={r.num_microbatches} compute {r.compute_s * 1e3:.1f} ms "
                         f"(plan {p * 1e3:.1f}) wait {r.wait_s * 1e3:.1f} ms reduce {r.reduce_s * 1e3:.1f} ms")
        return "\n".join(lines)


def gather_step_stats(local: RankTimes, plan, group: "dist.ProcessGroup | None", *,
                      device: torch.device | str = "cpu") -> StepStats:
    """All-gather every rank's RankTimes over the domain group (collective) and pair them with the plan."""
    mine = local.to_tensor().to(device)
    if group is None:
        rows = [mine]
    else:
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(rows, mine, group=group)
    ranks = tuple(sorted((RankTimes.from_tensor(row.cpu()) for row in rows), key=lambda r: r.domain_rank))
    busy = tuple(predicted_busy_s(plan))
    predicted = plan.est_step_time_s if plan.est_step_time_s > 0 else max(busy, default=0.0)
    return StepStats(ranks=ranks, predicted_busy_s=busy, predicted_step_s=predicted, policy=plan.policy)
