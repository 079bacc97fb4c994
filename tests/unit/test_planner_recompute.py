"""Restricting the recompute a planner may choose (CostModel allowed_recompute, --dcp-recompute):
no policy's plan ever uses a disallowed kind, every plan validates, validate rejects a plan that
breaks the restriction, and a sequence no allowed choice can hold is a clear ValueError."""
import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcp_megatron.planner.costmodel import CostModel, model_preset
from dcp_megatron.planner.plan import NO_RECOMPUTE, SELECTIVE, MicroBatch, Recompute
from dcp_megatron.planner.policies import POLICIES, make_plan
from dcp_megatron.planner.layout import candidate_sizes
from dcp_megatron.planner.validate import PlanError, validate
from tests.support.planner_helpers import plans_of_every_policy, tiny_cluster

RESTRICTIONS = [("none",), ("none", "selective"), ("full",), ("selective",), ("selective", "full"), ("none", "full")]


def restricted_cost(domain_size: int, allowed, *, pp: int = 1) -> CostModel:
    return CostModel(model_preset("gpt-tiny", pp=pp), tiny_cluster(domain_size), allowed_recompute=allowed)


def kinds_used(plan) -> set[str]:
    return {mb.recompute.kind for w in plan.waves for g in w.groups for mb in g.microbatches if mb.sequences}


def top_length(cost) -> int:
    """The longest sequence the largest group holds with the strongest allowed recompute."""
    size = candidate_sizes(cost.cluster)[-1]
    cap = cost.max_local_tokens(cost.strongest_recompute)
    return cap * size - (cap * size) % (2 * size)


@st.composite
def restricted_scenarios(draw):
    allowed = draw(st.sampled_from(RESTRICTIONS))
    cost = restricted_cost(draw(st.sampled_from([1, 2, 3, 4, 6, 8])), allowed, pp=draw(st.sampled_from([1, 2])))
    top = top_length(cost)
    shape = draw(st.sampled_from(["at-capacity", "mixed", "many-short"]))
    if shape == "at-capacity":
        lengths = [top] + draw(st.lists(st.integers(1, 2000), max_size=8))
    elif shape == "many-short":
        lengths = np.random.default_rng(draw(st.integers(0, 999))).integers(1, 256, draw(st.integers(50, 400))).tolist()
    else:
        lengths = draw(st.lists(st.integers(1, top), min_size=1, max_size=40))
    batch = [(3 * i + 1, int(n)) for i, n in enumerate(lengths)]
    return cost, batch, max(lengths)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(restricted_scenarios())
def test_no_policy_uses_a_disallowed_recompute(scenario):
    cost, batch, max_seq_len = scenario
    for policy, plan in plans_of_every_policy(batch, cost, max_seq_len).items():
        assert kinds_used(plan) <= set(cost.allowed_recompute), (policy, kinds_used(plan))
        validate(plan, batch, cost.cluster, cost)


@pytest.mark.parametrize("allowed", RESTRICTIONS)
def test_cost_model_choices_stay_allowed(allowed):
    cost = restricted_cost(4, allowed)
    assert {r.kind for r in cost.recompute_options()} == set(allowed)
    strongest_cap = cost.max_local_tokens(cost.strongest_recompute)
    for local in (1, 1000, min(cost.max_local_tokens(NO_RECOMPUTE) + 2, strongest_cap), strongest_cap):
        rc = cost.best_recompute_from_sums(float(local), 1e-3, 1e-4, 2)
        assert rc is not None and rc.kind in allowed
        assert cost.memory_from_tokens(local, rc) <= cost.cluster.mem_budget_bytes
    too_many = cost.max_local_tokens(cost.strongest_recompute) + 2
    assert cost.best_recompute_from_sums(float(too_many), 1e-3, 1e-4, 2) is None
    _, _, _, seconds = cost.doc_alone_seconds(np.array([2 * too_many, 10]), 2)
    assert seconds[0] == np.inf and np.isfinite(seconds[1])


def test_default_allows_all_and_matches_unrestricted():
    cluster = tiny_cluster(4)
    default = CostModel(model_preset("gpt-tiny"), cluster)
    explicit = CostModel(model_preset("gpt-tiny"), cluster, allowed_recompute=["full", "none", "selective"])
    assert default.allowed_recompute == explicit.allowed_recompute == ("none", "selective", "full")
    batch = [(i, n) for i, n in enumerate([9000, 5000, 300, 40, 2000, 7, 3000])]
    for policy in POLICIES:
        assert (make_plan(policy, batch, default, max_seq_len=9000).dumps()
                == make_plan(policy, batch, explicit, max_seq_len=9000).dumps())


def test_restriction_forces_recompute_where_none_would_do():
    """A short batch needs no recompute; allowing only full makes every micro-batch recompute."""
    cost = restricted_cost(4, ("full",))
    batch = [(i, 100 + i) for i in range(20)]
    for policy in POLICIES:
        plan = make_plan(policy, batch, cost, max_seq_len=200)
        assert kinds_used(plan) == {"full"}
        validate(plan, batch, cost.cluster, cost)


@pytest.mark.parametrize("bad, words", [((), ["at least one"]), (("none", "partial"), ["partial"]),
                                        ("none", ["string"]), (("Full",), ["Full"])])
def test_bad_allowed_recompute_is_rejected(bad, words):
    with pytest.raises(ValueError) as err:
        CostModel(model_preset("gpt-tiny"), tiny_cluster(2), allowed_recompute=bad)
    assert all(w in str(err.value) for w in words), str(err.value)


@pytest.mark.parametrize("policy", POLICIES)
def test_sequence_that_only_fits_with_more_recompute_is_a_clear_error(policy):
    full = restricted_cost(2, ("none", "selective", "full"))
    none_only = restricted_cost(2, ("none",))
    length = top_length(full)                  # fits with full recompute, not without
    assert length > top_length(none_only)
    make_plan(policy if policy != "static" else "dcp", [(5, length)], full, max_seq_len=length)
    with pytest.raises(ValueError) as err:
        make_plan(policy, [(5, length)], none_only, max_seq_len=length)
    msg = str(err.value)
    assert str(length) in msg and "['none']" in msg and "allow more recompute" in msg, msg


def test_validate_rejects_a_disallowed_recompute():
    allowed_all = restricted_cost(2, ("none", "selective", "full"))
    none_only = restricted_cost(2, ("none",))
    batch = [(1, 100), (2, 200)]
    plan = make_plan("dcp", batch, none_only, max_seq_len=200)
    validate(plan, batch, none_only.cluster, none_only)
    for forced in (SELECTIVE, Recompute("full", 1)):
        waves = tuple(dataclasses.replace(w, groups=tuple(
            dataclasses.replace(g, microbatches=tuple(MicroBatch(mb.sequences, forced) for mb in g.microbatches))
            for g in w.groups)) for w in plan.waves)
        bad = dataclasses.replace(plan, waves=waves)
        validate(bad, batch, allowed_all.cluster, allowed_all)
        with pytest.raises(PlanError, match=r"recompute: .*uses .*allows only \['none'\]"):
            validate(bad, batch, none_only.cluster, none_only)
