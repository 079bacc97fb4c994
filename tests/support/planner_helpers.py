"""Small cost models for planner tests: memory tight enough that CP size and recompute matter."""
from dcp_megatron.planner.costmodel import ClusterSpec, CostModel, model_preset
from dcp_megatron.planner.plan import StepPlan
from dcp_megatron.planner.policies import POLICIES, make_plan


def tiny_cluster(domain_size: int, *, gpus_per_node: int = 4, mem_bytes: int = 64 * 2 ** 20, **kw) -> ClusterSpec:
    """gpt-tiny on a made-up GPU: ~3K tokens per rank fit without recompute, ~8K with full."""
    return ClusterSpec(name="tiny", domain_size=domain_size, gpus_per_node=gpus_per_node, mem_bytes_per_gpu=mem_bytes,
                       gemm_flops=1e12, attn_rate_points=((64, 2e11), (4096, 6e11)), intra_node_bw=1e10,
                       inter_node_bw=1e9, microbatch_overhead_s=1e-4, collective_latency_s=1e-6, **kw)


def tiny_cost(domain_size: int, *, pp: int = 1, **kw) -> CostModel:
    return CostModel(model_preset("gpt-tiny", pp=pp), tiny_cluster(domain_size, **kw))


def plans_of_every_policy(batch, cost, max_seq_len: int) -> dict[str, StepPlan]:
    """Each policy's plan of the batch. Only a baseline may refuse, and only because its default setting
    cannot hold the batch: no static layout exists for this domain (its CP sizes must divide it), or a
    sequence fits none of the dynamic schedulers' CP sizes at their token cap; such a policy is left out."""
    plans = {}
    for policy in POLICIES:
        try:
            plans[policy] = make_plan(policy, batch, cost, max_seq_len=max_seq_len)
        except ValueError as err:
            assert policy != "dcp" and ("static layout" in str(err) or "fits no CP size" in str(err)), err
    return plans
