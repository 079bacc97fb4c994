"""Split planning on the ranks: each rank plans its own part of a large domain and gathers the others' parts.

Every rank of a DCP domain plans the same global batch. Above a few thousand ranks a whole plan costs a large share
of the step (docs/simulator.md), so with `--dcp-plan-part-ranks N` the domain's ranks share the work: the batch is
split into parts of N ranks (planner/dcp/split.py, the same split on every rank), each rank plans the part it
belongs to, and the parts are gathered on a gloo group of the domain, in two collectives with the run's timeout:
- one MAX all-reduce of the parts' encoded sizes (planner/plan_bytes.py);
- one all-gather in which rank j of a part sends the j-th slice of its part's bytes, so the domain moves each
  part's bytes once (not once per rank of the part).
Every rank then composes the same plan `make_plan(..., part_ranks=N)` returns in one process, its own part as it
planned it: where a part's ranks planned it differently, their plans differ, and the step's plan hash check
(core/planning.check_same_plan) stops every rank with its one-line message.

The gloo group is the planner's own: planning runs on the plan-ahead thread (planner/ahead.py) while training's
collectives run on the main thread, and two threads must never share a group (their collectives would pair up in
different orders on different ranks).
"""
from __future__ import annotations

import contextlib
import gc
import math
from datetime import timedelta
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from dcp_megatron.planner.dcp.search import plan_dcp_search, plan_part
from dcp_megatron.planner.dcp.split import assign_shares, compose, split_parts
from dcp_megatron.planner.plan import StepPlan
from dcp_megatron.planner.plan_bytes import plan_from_bytes, plan_to_bytes
from dcp_megatron.planner.policies import checked_inputs

def planning_groups(domains, *, timeout: timedelta):
    """One gloo group per DCP domain, created by every rank of the world in the same order; this rank's or None."""
    world_rank, mine = dist.get_rank(), None
    for ranks in domains:
        group = dist.new_group(list(ranks), timeout=timeout, backend="gloo")
        if world_rank in ranks:
            mine = group
    return mine


class SplitPlanner:
    """The plan function of a rank that plans its own part (module docstring); a batch that is planned whole
    (split.py's rules) is planned whole here too, without communication."""

    def __init__(self, *, policy: str, max_seq_len: int, part_ranks: int, domain_rank: int, group,
                 gather: Callable[..., list[bytes]] | None = None) -> None:
        """`gather(encoded, part_ranks=, num_parts=)`: every part's bytes (default: `gather_parts` on `group`;
        tools/bench_planner.py hands the parts' bytes in to time one rank's planning without ranks)."""
        if policy != "dcp":
            raise ValueError(f"split planning (--dcp-plan-part-ranks) plans the dcp policy, not {policy!r}")
        self.policy, self.max_seq_len, self.part_ranks = policy, max_seq_len, part_ranks
        self.domain_rank = domain_rank
        self._gather = gather or (lambda encoded, *, part_ranks, num_parts: gather_parts(
            encoded, part_ranks=part_ranks, domain_rank=domain_rank, num_parts=num_parts, group=group))

    def __call__(self, sequences, cost) -> StepPlan:
        ids, lengths, max_seq_len, _, bound = checked_inputs(self.policy, list(sequences), cost,
                                                             max_seq_len=self.max_seq_len, part_ranks=self.part_ranks)
        part_ranks = split_parts(lengths, cost, self.part_ranks, bound)
        if not part_ranks:   # every rank decides alike from the same lengths: no collective either way
            return plan_dcp_search(ids, lengths, cost, max_seq_len=max_seq_len, tuned={}, bound=bound)
        num_parts = cost.cluster.domain_size // part_ranks
        part = self.domain_rank // part_ranks
        part_of = assign_shares(ids, lengths, cost, num_parts)
        mine = plan_part(ids, lengths, cost, part_of, part, max_seq_len=max_seq_len, part_ranks=part_ranks,
                         bound=bound)
        encoded = plan_to_bytes(mine)
        try:
            gathered = self._gather(encoded, part_ranks=part_ranks, num_parts=num_parts)
        except RuntimeError as err:   # gloo's timeout or a peer gone: say what this rank was doing
            raise RuntimeError(f"split planning: domain rank {self.domain_rank} (part {part} of {num_parts}, "
                               f"{part_ranks} ranks each) could not gather the parts' plans: another rank of the "
                               f"domain stopped, or planned this batch differently (every rank needs the same "
                               f"flags, --dcp-profile and code): {err}") from err
        # a rank composes its own part as it planned it and the others as gathered: if a part's ranks disagree,
        # their plans differ from each other's and from the other ranks', and the step's hash check stops every rank
        parts = []
        with _collection_paused():
            for p, data in enumerate(gathered):
                try:
                    parts.append(mine if p == part else plan_from_bytes(data))
                except ValueError:           # a part whose ranks sent slices of different plans: idle in this plan
                    parts.append(StepPlan(domain_size=part_ranks, waves=()))
            return compose(parts, cost, bound)


@contextlib.contextmanager
def _collection_paused():
    """Python's cyclic garbage collector off while the other parts' objects are built: they hold no cycles, and at
    16,384 ranks the collections it starts among ~250,000 new tuples took half the decoding time (measured)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def gather_parts(encoded: bytes, *, part_ranks: int, domain_rank: int, num_parts: int, group) -> list[bytes]:
    """Every part's bytes on every rank of the domain: rank j of a part sends slice j of its part's bytes."""
    size = torch.tensor([len(encoded)], dtype=torch.int64)
    dist.all_reduce(size, op=dist.ReduceOp.MAX, group=group)
    slice_bytes = math.ceil((int(size) + 8) / part_ranks)
    framed = len(encoded).to_bytes(8, "little") + encoded
    j = domain_rank % part_ranks
    piece = np.zeros(slice_bytes, dtype=np.uint8)
    chunk = np.frombuffer(framed[j * slice_bytes:(j + 1) * slice_bytes], dtype=np.uint8)
    piece[:chunk.size] = chunk
    pieces = [torch.empty(slice_bytes, dtype=torch.uint8) for _ in range(num_parts * part_ranks)]
    dist.all_gather(pieces, torch.from_numpy(piece), group=group)
    out = []
    for p in range(num_parts):
        data = b"".join(t.numpy().tobytes() for t in pieces[p * part_ranks:(p + 1) * part_ranks])
        out.append(data[8:8 + int.from_bytes(data[:8], "little")])
    return out
