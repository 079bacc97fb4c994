"""Plans for pretrain_gpt.py: the cost model of this run and one StepPlan per global batch.

Every rank builds the same cost model from the same flags and plans the same global batch,
so all ranks hold the same plan without communicating (DESIGN.md section 2).

- `--dcp`: the planner policy named by `--dcp-policy` (default "dcp").
- no `--dcp`: Megatron's static layout exactly as the flags describe it, run through the same
  runtime: CP size `--context-parallel-size` for every sequence, sequences packed in order
  into micro-batches of at most `--seq-length` tokens, micro-batches dealt round-robin to the
  D / C replicas, the run's `--recompute-granularity` on every micro-batch; with PP > 1 every
  replica runs the same count (the tail filled with empty micro-batches).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib

from dcp_megatron.planner.cluster import cluster_preset
from dcp_megatron.planner.cost import RECOMPUTE_KINDS, CostModel, load_profile
from dcp_megatron.planner.model import ModelShape
from dcp_megatron.planner.plan import NO_RECOMPUTE, SELECTIVE, Group, MicroBatch, Recompute, StepPlan, Wave
from dcp_megatron.planner.policies import make_plan
from dcp_megatron.planner.timeline import plan_makespan

GiB = 1024 ** 3


def model_shape(args: argparse.Namespace, *, padded_vocab_size: int) -> ModelShape:
    return ModelShape(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_heads=args.num_attention_heads,
        num_kv_heads=args.num_query_groups, head_dim=args.hidden_size // args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size, vocab_size=padded_vocab_size, gated_mlp=args.swiglu,
        tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size)


def build_cost_model(args: argparse.Namespace, *, padded_vocab_size: int, domain_size: int,
                     has_gpu: bool) -> CostModel:
    """Cluster preset "h200" on GPU, "cpu" without; --dcp-* flags and --dcp-profile override it."""
    cluster = cluster_preset("h200" if has_gpu else "cpu", domain_size=domain_size)
    changes = {}
    if args.dcp_max_cp_size is not None:
        changes["max_cp_size"] = args.dcp_max_cp_size
    if args.dcp_memory_budget_gb is not None:
        changes["mem_bytes_per_gpu"] = int(args.dcp_memory_budget_gb * GiB)
    if changes:
        cluster = dataclasses.replace(cluster, **changes)
    profile = load_profile(args.dcp_profile) if args.dcp_profile else None
    return CostModel(model_shape(args, padded_vocab_size=padded_vocab_size), cluster, profile=profile,
                     allowed_recompute=allowed_recompute(args))


def allowed_recompute(args: argparse.Namespace) -> tuple[str, ...]:
    """--dcp-recompute as a tuple of kinds (all three when not given)."""
    if not getattr(args, "dcp_recompute", None):
        return RECOMPUTE_KINDS
    return tuple(r.strip() for r in args.dcp_recompute.split(",") if r.strip())


def static_recompute(args: argparse.Namespace) -> Recompute:
    if args.recompute_granularity == "full":
        return Recompute("full", args.recompute_num_layers)
    if args.recompute_granularity == "selective":
        return SELECTIVE
    return NO_RECOMPUTE


def static_cp_plan(sequences, cost: CostModel, *, cp_size: int, tokens_per_microbatch: int,
                   recompute: Recompute) -> StepPlan:
    """Megatron's static layout of one global batch (see the module docstring)."""
    domain_size = cost.cluster.domain_size
    if domain_size % cp_size:
        raise ValueError(f"context-parallel size {cp_size} does not divide the DP x CP domain of {domain_size} ranks")
    packed: list[list[tuple[int, int]]] = []
    used = tokens_per_microbatch
    for seq_id, length in sequences:
        if used + length > tokens_per_microbatch:
            packed.append([])
            used = 0
        packed[-1].append((int(seq_id), int(length)))
        used += length
    replicas = domain_size // cp_size
    dealt = [packed[r::replicas] for r in range(replicas)]

    def microbatch(seqs, first_rank: int) -> MicroBatch:
        lengths = [n for _, n in seqs]
        est = cost.microbatch_time(lengths, cp_size, first_rank=first_rank, recompute=recompute) if seqs else 0.0
        mem = cost.microbatch_memory(lengths, cp_size, recompute=recompute) if seqs else 0
        return MicroBatch(tuple(seqs), recompute, est, mem)

    if cost.model.pp == 1:
        waves = (Wave(tuple(Group(r * cp_size, cp_size, tuple(microbatch(s, r * cp_size) for s in dealt[r]))
                            for r in range(replicas))),)
    else:
        count = max(len(d) for d in dealt)
        waves = tuple(Wave(tuple(Group(r * cp_size, cp_size,
                                       (microbatch(dealt[r][w] if w < len(dealt[r]) else (), r * cp_size),))
                                 for r in range(replicas)))
                      for w in range(count))
    plan = StepPlan(domain_size=domain_size, waves=waves, policy=f"megatron-static-cp{cp_size}")
    return dataclasses.replace(plan, est_step_time_s=plan_makespan(plan))


def plan_step(args: argparse.Namespace, sequences, cost: CostModel) -> StepPlan:
    """The plan every rank runs for a global batch [(seq_id, length)]."""
    if args.dcp:
        return make_plan(args.dcp_policy, list(sequences), cost, max_seq_len=args.seq_length)
    return static_cp_plan(sequences, cost, cp_size=args.context_parallel_size,
                          tokens_per_microbatch=args.seq_length, recompute=static_recompute(args))


def check_same_plan(plan: StepPlan, *, iteration: int, device) -> None:
    """Debug check (collective over the world): every rank planned the same step."""
    import torch
    import torch.distributed as dist

    digest = int.from_bytes(hashlib.sha256(plan.dumps().encode()).digest()[:7], "little")
    low = torch.tensor([digest], dtype=torch.int64, device=device)
    high = low.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    if int(low) != int(high):
        raise RuntimeError(f"iteration {iteration}: ranks computed different plans (hash {digest:x} here); "
                           "planning must be deterministic")
