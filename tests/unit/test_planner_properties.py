"""Property tests over random batches, domain sizes (incl. 1, 3, 6, 12) and PP on/off:
every policy's plan validates and fits memory, dcp never loses to a baseline, plans are
deterministic, and no plan beats the (memory-aware) lower bound, whatever recompute is allowed."""
import dataclasses
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dcp_megatron.planner.costmodel import CostModel, model_preset
from dcp_megatron.planner.plan import Recompute
from dcp_megatron.planner.policies import make_plan
from dcp_megatron.planner.layout import candidate_sizes
from dcp_megatron.planner.padding import local_tokens
from dcp_megatron.planner.timeline import plan_makespan
from dcp_megatron.planner.validate import validate
from tests.support.planner_helpers import plans_of_every_policy, tiny_cluster, tiny_cost

DOMAINS = [1, 2, 3, 4, 6, 8, 12, 16]


def largest_fitting_length(cost) -> int:
    """The longest sequence that fits the domain's largest group with full recompute: exactly at capacity."""
    size = candidate_sizes(cost.cluster)[-1]
    cap = cost.max_local_tokens(Recompute("full", cost.layers_per_stage))
    return cap * size - (cap * size) % (2 * size)


@st.composite
def scenarios(draw):
    domain_size = draw(st.sampled_from(DOMAINS))
    pp = draw(st.sampled_from([1, 2]))
    allowed = draw(st.sampled_from([("none", "selective", "full"), ("none", "full"), ("selective", "full")]))
    cost = CostModel(model_preset("gpt-tiny", pp=pp), tiny_cluster(domain_size), allowed_recompute=allowed)
    top = largest_fitting_length(cost)
    shape = draw(st.sampled_from(["single-token", "at-capacity", "one-huge", "all-equal", "many-short", "mixed"]))
    if shape == "single-token":
        lengths = [1]
    elif shape == "at-capacity":
        lengths = [top] + draw(st.lists(st.integers(1, 500), max_size=5))
    elif shape == "one-huge":
        lengths = [draw(st.integers(top // 2, top))] + draw(st.lists(st.integers(1, 300), min_size=1, max_size=60))
    elif shape == "all-equal":
        lengths = [draw(st.integers(1, min(top, 6000)))] * draw(st.integers(1, 40))
    elif shape == "many-short":
        rng = np.random.default_rng(draw(st.integers(0, 2 ** 16)))
        lengths = rng.integers(1, 64, draw(st.integers(500, 2500))).tolist()
    else:
        lengths = draw(st.lists(st.integers(1, top), min_size=1, max_size=40))
    # the batch order; for the 500-2500 short documents from the seed's generator: a permutation drawn
    # element by element costs hypothesis up to ~100 ms per example, and these lengths are i.i.d. anyway
    order = rng.permutation(len(lengths)) if shape == "many-short" else draw(st.permutations(range(len(lengths))))
    first_id = draw(st.integers(0, 10 ** 6))
    batch = [(first_id + 7 * i, int(lengths[j])) for i, j in enumerate(order)]
    cap = max(max(lengths), draw(st.sampled_from([max(lengths), top])))
    return cost, batch, cap


# examples in the slow run (`make test-slow`, run by CI after the suite): 3,000 keep make test-slow inside its
# 15 minutes beside this round's out-of-memory and DeepSeek launches (10,000 took ~650 s of one worker, 2026-12-07);
# DCP_SLOW_EXAMPLES=10000 for the longer soak
_SLOW = int(os.environ.get("DCP_SLOW_EXAMPLES", 3_000))
# each start-checked example searches its least budget and plans every policy (~0.16 s): 300 keep make test-slow
# inside its 15 minutes (10,000 took ~27 min); DCP_SLOW_START_EXAMPLES for a longer soak
_SLOW_START_CHECKED = int(os.environ.get("DCP_SLOW_START_EXAMPLES", 300))
_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large]


@settings(max_examples=60, deadline=None, suppress_health_check=_QUIET)
@given(scenarios())
def test_policies_hold_every_invariant(scenario):
    check_every_invariant(scenario)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@settings(max_examples=_SLOW, deadline=None, suppress_health_check=_QUIET)
@given(scenarios())
def test_policies_hold_every_invariant_at_slow_examples(scenario):
    check_every_invariant(scenario)


def check_every_invariant(scenario):
    cost, batch, max_seq_len = scenario
    times = {}
    for policy, plan in plans_of_every_policy(batch, cost, max_seq_len).items():
        validate(plan, batch, cost.cluster, cost)
        peak = max((mb.est_mem_bytes for w in plan.waves for g in w.groups for mb in g.microbatches), default=0)
        assert peak <= cost.cluster.mem_budget_bytes
        assert plan.est_step_time_s == plan_makespan(plan)
        assert plan.lower_bound_s <= plan.est_step_time_s * (1 + 1e-9)
        assert make_plan(policy, batch, cost, max_seq_len=max_seq_len).dumps() == plan.dumps()
        times[policy] = plan.est_step_time_s
    baselines = [t for p, t in times.items() if p != "dcp"]
    assert times["dcp"] <= min(baselines, default=np.inf)


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(DOMAINS), st.integers(1, 40), st.integers(0, 1000))
def test_local_tokens_cover_each_document(domain_size, length, offset):
    check_local_tokens(domain_size, length, offset)


@pytest.mark.slow
@settings(max_examples=_SLOW, deadline=None)
@given(st.sampled_from(DOMAINS), st.integers(1, 1 << 20), st.integers(0, 1000))
def test_local_tokens_cover_each_document_at_slow_examples(domain_size, length, offset):
    check_local_tokens(domain_size, length, offset)


def check_local_tokens(domain_size, length, offset):
    """Padding to 2c never loses tokens and adds fewer than 2c."""
    lengths = np.array([length + offset])
    for size in candidate_sizes(tiny_cost(domain_size).cluster):
        padded = int(local_tokens(lengths, size)[0]) * size
        assert lengths[0] <= padded < lengths[0] + 2 * size and padded % (2 * size) == 0


# ---------------------------------------------- any budget the start check passes plans every batch (issue 46)

def _counted_model(spec_name: str):
    """A tiny GPT under the count a run uses: CPU_FP32 per CP size (2 layers, hidden 64, GELU, a small vocabulary,
    where a layer's backward is the peak and full 2 counts more than full 1) or Transformer Engine's."""
    from dcp_megatron.planner.costmodel.memory_spec import CPU_FP32
    from dcp_megatron.planner.costmodel import ModelShape

    if spec_name == "te":
        return model_preset("gpt-tiny")
    return ModelShape(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=4, head_dim=16, ffn_hidden_size=256,
                      vocab_size=384, gated_mlp=False, transformer_impl="local", sequence_parallel=False,
                      activations=CPU_FP32)


@st.composite
def start_checked_scenarios(draw):
    """A cost model at a budget the start check passes (from the least such budget up to 3x it) and a batch of
    packed samples: documents cut at --seq-length beside short ones, as the data loader hands them over."""
    from dcp_megatron.planner.costmodel import cpu_cluster
    from dcp_megatron.planner.start_fit import smallest_memory_bytes

    spec_name = draw(st.sampled_from(["cpu", "cpu", "te"]))
    domain_size = draw(st.sampled_from([1, 2, 3, 4]))
    seq_length = draw(st.sampled_from([256, 512, 1024, 2048]))
    allowed = draw(st.sampled_from([("none", "selective", "full", "mlp"), ("none", "full"), ("selective", "full")]))
    cost = CostModel(_counted_model(spec_name), cpu_cluster(domain_size), allowed_recompute=allowed)
    least = smallest_memory_bytes(cost.with_cluster(mem_bytes_per_gpu=1024), seq_length)   # searched up from 1 KiB
    cost = cost.with_cluster(mem_bytes_per_gpu=int(least * draw(st.one_of(st.floats(1.0, 1.3), st.floats(1.0, 3.0)))))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    shortest, longest = draw(st.sampled_from([(1, 64), (40, 3000), (1, seq_length), (seq_length, 4 * seq_length)]))
    num_samples = draw(st.integers(1, 16))
    if draw(st.booleans()):        # packed samples: a stream of documents cut into --seq-length windows
        docs = rng.integers(shortest, longest + 1, num_samples * seq_length // max(shortest, 1) + 2)
        stream = np.repeat(np.arange(docs.size), docs)[:num_samples * seq_length]
        lengths = [int(c) for window in np.split(stream, np.arange(seq_length, stream.size, seq_length))
                   for c in np.unique(window, return_counts=True)[1]]
    else:
        lengths = rng.integers(1, seq_length + 1, draw(st.integers(1, 40))).tolist()
    return cost, [(i, n) for i, n in enumerate(lengths)], seq_length


def _issue_46_step_1():
    """The run of issue 46 that died at step 1: 2 CPU ranks, --seq-length 1024, --dcp-memory-budget-gb 0.007, a
    global batch of 4 packed samples (megatron-dynamic's layout packed 596 local tokens under full 1, which holds
    more than full 2 here; the relief pass found no relief for it)."""
    from dcp_megatron.planner.costmodel import GiB, cpu_cluster

    cost = CostModel(_counted_model("cpu"), dataclasses.replace(cpu_cluster(2), mem_bytes_per_gpu=int(0.007 * GiB)),
                     allowed_recompute=("none", "selective", "full", "mlp"))
    return cost, list(enumerate([1019, 5, 1024, 1024, 864, 160])), 1024


@settings(max_examples=40, deadline=None, suppress_health_check=_QUIET)
@given(start_checked_scenarios())
@example(_issue_46_step_1())
def test_every_policy_plans_any_batch_at_a_budget_the_start_check_passes(scenario):
    check_plans_at_start_checked_budget(scenario)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@settings(max_examples=_SLOW_START_CHECKED, deadline=None, suppress_health_check=_QUIET)
@given(start_checked_scenarios())
def test_every_policy_plans_any_batch_at_a_budget_the_start_check_passes_at_slow_examples(scenario):
    check_plans_at_start_checked_budget(scenario)


def check_plans_at_start_checked_budget(scenario):
    cost, batch, seq_length = scenario
    for policy, plan in plans_of_every_policy(batch, cost, seq_length).items():
        validate(plan, batch, cost.cluster, cost)
