"""The DCP domains of a Megatron run and the runtime's group pool over them.

Megatron's own context-parallel size stays 1 under this runtime: the plan decides CP per
micro-batch, so Megatron's data-parallel group of each TP/PP coordinate IS the DP x CP domain
the plan re-partitions (`get_data_parallel_group(with_context_parallel=True)`), and its DDP
reduces gradients over exactly that domain. With Megatron's default rank order
"tp-cp-ep-dp-pp" (CP = 1), global rank = tp_rank + tp * (dp_rank + dp * pp_rank).
"""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from dcp_megatron.runtime.group_pool import GroupPool


def dcp_domains(*, world_size: int, tp_size: int, pp_size: int) -> list[list[int]]:
    """Global ranks of every TP/PP coordinate's domain, each in domain-rank order."""
    if world_size % (tp_size * pp_size):
        raise ValueError(f"world size {world_size} is not divisible by TP {tp_size} x PP {pp_size}")
    dp_size = world_size // (tp_size * pp_size)
    return [[tp_rank + tp_size * (dp_rank + dp_size * pp_rank) for dp_rank in range(dp_size)]
            for pp_rank in range(pp_size) for tp_rank in range(tp_size)]


def build_group_pool(*, tp_size: int, pp_size: int, timeout: timedelta) -> GroupPool:
    """The pool of CP groups of every domain (collective over the world: call on every rank)."""
    from megatron.core import parallel_state

    domains = dcp_domains(world_size=dist.get_world_size(), tp_size=tp_size, pp_size=pp_size)
    pool = GroupPool(domains, timeout=timeout)
    megatron_domain = dist.get_process_group_ranks(parallel_state.get_data_parallel_group(with_context_parallel=True))
    assert pool.domain_ranks == list(megatron_domain), (pool.domain_ranks, megatron_domain)
    return pool
