"""Planning ahead on a worker thread: the same plans as synchronous planning, errors in the caller."""
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_megatron.planner.ahead import PlanAhead, plan_synchronously
from dcp_megatron.planner.costmodel import CostModel, cluster_preset, model_preset
from dcp_megatron.planner.policies import make_plan

COST = CostModel(model_preset("llama3-8b"), cluster_preset("h200", domain_size=16))
MAX_SEQ_LEN = 262_144


def _plan(sequences):
    return make_plan("dcp", sequences, COST, max_seq_len=MAX_SEQ_LEN)


@settings(max_examples=15, deadline=None)
@given(steps=st.lists(st.lists(st.integers(1, MAX_SEQ_LEN), min_size=1, max_size=40), min_size=2, max_size=5))
def test_plans_made_ahead_equal_synchronous_plans(steps):
    batches = [list(enumerate(lengths)) for lengths in steps]
    ahead = PlanAhead(_plan)
    try:
        planned = [plan_synchronously(0, _plan, batches[0])]
        for k in range(1, len(batches)):
            ahead.submit(k, batches[k])
            assert ahead.pending(k)
            planned.append(ahead.result(k))
    finally:
        ahead.close()
    for k, (step, batch) in enumerate(zip(planned, batches)):
        assert step.step == k and step.plan_s >= 0 and step.exposed_s >= 0 and step.ahead == (k > 0)
        assert step.plan.dumps() == _plan(batch).dumps()


def test_planning_runs_on_another_thread_while_the_caller_goes_on():
    """Deterministic (no timing): the plan function blocks until the caller, still running, releases it."""
    threads, started, release = [], threading.Event(), threading.Event()

    def blocking_plan(value):
        threads.append(threading.get_ident())
        started.set()
        assert release.wait(timeout=60), "the caller never released the plan"
        return value

    ahead = PlanAhead(blocking_plan)
    try:
        ahead.submit(1, "plan of step 1")
        assert started.wait(timeout=60)      # planning began while this thread was free to "train"
        assert ahead.pending(1)
        release.set()
        step = ahead.result(1)
    finally:
        ahead.close()
    assert step.plan == "plan of step 1" and step.ahead and step.step == 1
    assert threads == [threads[0]] and threads[0] != threading.get_ident()
    assert step.plan_s >= 0 and step.exposed_s >= 0


def test_errors_reach_the_caller_and_misuse_is_refused():
    def failing(_):
        raise ValueError("sample 3 fits no CP group")

    ahead = PlanAhead(failing)
    try:
        ahead.submit(2, None)
        with pytest.raises(ValueError, match="still pending"):
            ahead.submit(3, None)
        with pytest.raises(ValueError, match="fits no CP group"):
            ahead.result(2)
        with pytest.raises(ValueError, match="was not submitted"):
            ahead.result(2)
        ahead.submit(4, None)
        ahead.discard()
        assert not ahead.pending(4)
    finally:
        ahead.close()
