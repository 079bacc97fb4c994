"""Communicators for the CP groups a plan may use, created once and cached.

A DCP domain is the list of global ranks that one TP/PP coordinate re-partitions every step
(Megatron's DP x CP group). All ranks of the world construct the pool with the same list of
domains (all of the same size, since every coordinate runs the same plan), and a plan names its
groups by domain-relative blocks (first_rank, size).

Start-up: every aligned power-of-two block (size 2, 4, ... at offsets that are multiples of the
size) and the whole domain are created in one global order — block after block, domain after
domain — with every rank of the world calling `new_group` (torch requires it unless
`use_local_synchronization=True`).

Other blocks (sizes 3, 5, 6, ... at any offset, which non-power-of-two domains need) are created
on first use: `ensure_groups(blocks)` creates the missing ones for every domain, in sorted order,
with every rank of the world calling it with the same blocks. The step loop (core/step_loop.py) calls it at the
start of each step with the blocks of that step's plan; every rank computes the same plan, so all ranks
agree without communicating, and a step whose blocks all exist costs nothing. At most `max_odd_blocks`
of them are kept (each is an NCCL communicator with its own device buffers on GPU): past that, the
least recently used ones the step does not need are destroyed, in the same order on every rank, so the
number of communicators a rank holds is bounded and the planner reserves their memory
(planner/costmodel/gpu_costs.py) instead of a long run growing into an OOM.

Why not `new_group(ranks, use_local_synchronization=True)` at the moment a group is needed: in
torch 2.13 such a group's store prefix is a hash of its ranks AND of how many groups the calling
rank has registered so far. Ranks are members of different start-up blocks (on a domain of 3,
ranks 0-1 hold block [0, 2) and rank 2 holds none), so the members derive different names and the
rendezvous waits until it times out (reproduced: DistStoreError "wait timeout" on all 3 ranks).
"""
from __future__ import annotations

from datetime import timedelta
from typing import Iterable, Sequence

import torch.distributed as dist

from dcp_megatron.planner.costmodel.gpu_costs import MAX_ODD_COMMUNICATORS

Block = tuple[int, int]  # (first domain rank, size)


def aligned_power_of_two_blocks(domain_size: int) -> list[Block]:
    """Every aligned block of size 2, 4, 8, ... that fits in [0, domain_size), smallest first."""
    blocks = []
    size = 2
    while size <= domain_size:
        blocks.extend((first, size) for first in range(0, domain_size - size + 1, size))
        size *= 2
    return blocks


def plan_blocks(plan) -> set[Block]:
    """The (first_rank, size) blocks of size > 1 that a StepPlan's groups use."""
    return {(g.first_rank, g.size) for wave in plan.waves for g in wave.groups if g.size > 1}


class GroupPool:
    """Cached process groups over contiguous blocks of this rank's DCP domain."""

    def __init__(self, domains: Sequence[Sequence[int]], *, timeout: timedelta,
                 backend: str | None = None, max_odd_blocks: int = MAX_ODD_COMMUNICATORS) -> None:
        if max_odd_blocks < 1:
            raise ValueError(f"max_odd_blocks must be >= 1, got {max_odd_blocks}")
        self._max_odd_blocks = max_odd_blocks
        self._odd_blocks: list[Block] = []   # created on first use, least recently used first
        if not dist.is_initialized():
            raise ValueError("GroupPool needs an initialised default process group (init_process_group first)")
        if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
            raise ValueError(f"GroupPool timeout must be a positive timedelta, got {timeout!r}")
        self._domains = [list(map(int, d)) for d in domains]
        self._check_domains(dist.get_world_size())
        self._timeout = timeout
        self._backend = backend
        rank = dist.get_rank()
        matches = [i for i, d in enumerate(self._domains) if rank in d]
        if len(matches) != 1:
            raise ValueError(f"global rank {rank} must be in exactly one domain, found in {len(matches)} "
                             f"of {self._domains}")
        self._domain_index = matches[0]
        self._domain_rank = self._domains[self._domain_index].index(rank)
        self._created: set[Block] = set()
        self._member_groups: dict[Block, dist.ProcessGroup] = {}
        startup = aligned_power_of_two_blocks(self.domain_size)
        if self.domain_size > 1 and (0, self.domain_size) not in startup:
            startup.append((0, self.domain_size))  # gradient reduction spans the whole domain
        self._create(startup)

    def _check_domains(self, world_size: int) -> None:
        if not self._domains or any(not d for d in self._domains):
            raise ValueError(f"domains must be a non-empty list of non-empty rank lists, got {self._domains}")
        sizes = {len(d) for d in self._domains}
        if len(sizes) != 1:
            raise ValueError(f"all domains must have the same size (they run the same plan), got sizes "
                             f"{[len(d) for d in self._domains]}")
        flat = [r for d in self._domains for r in d]
        if len(set(flat)) != len(flat):
            raise ValueError(f"domains must be disjoint and free of repeats, got {self._domains}")
        unsorted = [d for d in self._domains if d != sorted(d)]
        if unsorted:
            # new_group orders members by global rank; group rank must equal position in the block.
            raise ValueError(f"each domain must list its ranks in increasing order, got {unsorted[:2]}")
        bad = [r for r in flat if not 0 <= r < world_size]
        if bad:
            raise ValueError(f"domain ranks {bad} are outside the world [0, {world_size})")

    # ---- what this rank sees -------------------------------------------------------------------
    @property
    def domain_rank(self) -> int:
        return self._domain_rank

    @property
    def domain_size(self) -> int:
        return len(self._domains[0])

    @property
    def domains(self) -> list[list[int]]:
        """Every domain's global ranks (the same list on every rank)."""
        return [list(d) for d in self._domains]

    @property
    def domain_ranks(self) -> list[int]:
        """Global ranks of this rank's domain, in domain-rank order."""
        return list(self._domains[self._domain_index])

    @property
    def domain_group(self) -> "dist.ProcessGroup | None":
        """The whole domain (None when the domain is a single rank)."""
        return self.group(0, self.domain_size)

    @property
    def timeout(self) -> timedelta:
        return self._timeout

    @property
    def created_blocks(self) -> frozenset[Block]:
        """Blocks that exist (in every domain), the same set on every rank."""
        return frozenset(self._created)

    def group(self, first_rank: int, size: int) -> "dist.ProcessGroup | None":
        """The group over domain ranks [first_rank, first_rank + size), which must contain this rank.

        None for size 1 (nothing to communicate). A block that does not exist yet is created here,
        which is collective over the world: prefer `ensure_groups` with the step's blocks first.
        """
        self._check_block(first_rank, size)
        if not first_rank <= self._domain_rank < first_rank + size:
            raise ValueError(f"domain rank {self._domain_rank} is not in block [{first_rank}, {first_rank + size})")
        if size == 1:
            return None
        if (first_rank, size) not in self._created:
            self.ensure_groups([(first_rank, size)])
        return self._member_groups[(first_rank, size)]

    def ensure_groups(self, blocks: Iterable[Block]) -> int:
        """Create the missing blocks in every domain; returns how many were new.

        Collective over the whole world: every rank must call it with the same blocks (it does when
        they come from the same plan). Nothing is communicated when all blocks already exist.
        """
        wanted = set()
        for first_rank, size in blocks:
            self._check_block(first_rank, size)
            if size > 1:
                wanted.add((int(first_rank), int(size)))
        missing = sorted(wanted - self._created, key=lambda b: (b[1], b[0]))
        self._create(missing)
        used = sorted((b for b in wanted if b in self._odd_blocks or b in missing), key=lambda b: (b[1], b[0]))
        self._odd_blocks = [b for b in self._odd_blocks if b not in wanted] + used
        self._evict_unused(keep=wanted)
        return len(missing)

    def _evict_unused(self, *, keep: set[Block]) -> None:
        """Destroy the least recently used odd blocks beyond the cap (never one this step uses)."""
        excess = max(len(self._odd_blocks) - self._max_odd_blocks, 0)
        for block in [b for b in self._odd_blocks if b not in keep][:excess]:
            group = self._member_groups.pop(block, None)
            if group is not None:
                dist.destroy_process_group(group)   # local: frees this rank's communicator and its buffers
            self._created.discard(block)
            self._odd_blocks.remove(block)

    # ---- internals -----------------------------------------------------------------------------
    def _check_block(self, first_rank: int, size: int) -> None:
        if size < 1 or first_rank < 0 or first_rank + size > self.domain_size:
            raise ValueError(f"block (first_rank={first_rank}, size={size}) is outside the domain "
                             f"[0, {self.domain_size})")

    def _create(self, blocks: Sequence[Block]) -> None:
        # One global order: block after block, domain after domain, identical on every rank.
        for first_rank, size in blocks:
            for index, domain in enumerate(self._domains):
                ranks = domain[first_rank:first_rank + size]
                group = dist.new_group(ranks, timeout=self._timeout, backend=self._backend)
                if index == self._domain_index and first_rank <= self._domain_rank < first_rank + size:
                    self._member_groups[(first_rank, size)] = group
            self._created.add((first_rank, size))
