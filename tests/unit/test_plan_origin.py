"""A dcp plan's origin (own layout, a baseline's layout with dcp's reliefs, a baseline's plan) in its log label,
its dcp/* scalars, its dump and the simulator's breakdown; tests/support's is_own_plan counts own plans apart."""
import dataclasses

import pytest

from dcp_megatron.core.plan_log import plan_summary
from dcp_megatron.planner.plan import Group, MicroBatch, StepPlan, Wave
from dcp_megatron.planner.plan_origin import plan_label, plan_origin
from dcp_megatron.runtime.step_scalars import plan_scalars
from dcp_megatron.simulate_report import PolicyRun, format_origins, summarize
from tests.support.megatron_runs import is_own_plan, parse_output

OWN_PLAN = StepPlan(domain_size=1, waves=(Wave((Group(0, 1, (MicroBatch(((0, 8),)),)),)),), policy="dcp",
                    est_step_time_s=1.0, lower_bound_s=1.0)
SEEDED = dataclasses.replace(OWN_PLAN, extra={"seeded_from": "megatron-dynamic"})
FALLBACK = dataclasses.replace(OWN_PLAN, extra={"fallback": "static"})


def _log_line(plan, iteration=1) -> str:
    return (f" dcp iteration {iteration:8d} | {plan_summary(plan)} | predicted (ms): 1.0 | forward-backward (ms): "
            f"2.0 (before the schedule 0.1) |")


def test_the_log_label_names_a_seeded_plan_as_one_token_the_runs_parser_reads():
    labels = [plan_label(p) for p in (OWN_PLAN, SEEDED, FALLBACK)]
    assert labels == ["dcp", "dcp(seeded:megatron-dynamic)", "dcp(fallback:static)"]
    steps = parse_output(0, "\n".join(_log_line(p, i) for i, p in enumerate((OWN_PLAN, SEEDED, FALLBACK), 1)))
    assert [steps.dcp_steps[i]["policy"] for i in (1, 2, 3)] == labels
    assert [is_own_plan(label) for label in labels] == [True, False, False]
    assert [is_own_plan(p) for p in (OWN_PLAN, SEEDED, FALLBACK)] == [True, False, False]
    assert not is_own_plan("static") and not is_own_plan(dataclasses.replace(OWN_PLAN, policy="static"))
    # a seed name with a space still gives one token; the dump keeps the origin
    assert plan_label(dataclasses.replace(OWN_PLAN, extra={"seeded_from": "megatron-dynamic at cap 9"})) == \
        "dcp(seeded:megatron-dynamicatcap9)"
    assert plan_origin(StepPlan.from_json(SEEDED.dumps())) == ("seeded", "megatron-dynamic")


def test_scalars_say_seeded_apart_from_fallback_and_own():
    assert [(plan_scalars(p)["dcp/seeded"], plan_scalars(p)["dcp/fallback"]) for p in (OWN_PLAN, SEEDED, FALLBACK)] \
        == [(0.0, 0.0), (1.0, 0.0), (0.0, 1.0)]


def test_the_simulator_breaks_dcps_steps_down_by_origin():
    def run(name, plans, times):
        r = PolicyRun(name=name, mem_bytes_per_gpu=100)
        for plan, t in zip(plans, times):
            r.add_step(step_time_s=t, lower_bound_s=1.0, num_tokens=10, plan_s=0.001, plan=plan)
        return r

    peer = dataclasses.replace(OWN_PLAN, policy="megatron-dynamic")
    runs = {"megatron-dynamic": run("megatron-dynamic", [peer] * 4, [4.0, 3.0, 2.0, 2.0]),
            "dcp": run("dcp", [OWN_PLAN, SEEDED, SEEDED, FALLBACK], [2.0, 2.0, 1.5, 2.0])}
    origins = summarize(runs)["dcp"]["plan_origins"]
    assert origins["own"] == {"steps": 1, "time_share": pytest.approx(2.0 / 7.5), "lead_share": pytest.approx(2 / 3.5),
                              "sources": {}}
    assert origins["seeded"] == {"steps": 2, "time_share": pytest.approx(3.5 / 7.5),
                                 "lead_share": pytest.approx(1.5 / 3.5), "sources": {"megatron-dynamic": 2}}
    assert origins["fallback"]["steps"] == 1 and origins["fallback"]["lead_share"] == pytest.approx(0.0)
    assert format_origins(summarize(runs)) == (
        "\ndcp's plans over 4 steps: own 1 (27% of its time, 57% of its lead), seeded 2 (47% of its time, 43% of its "
        "lead; megatron-dynamic x2), fallback 1 (27% of its time, 0% of its lead; static x1)")
    assert format_origins(summarize({"megatron-dynamic": runs["megatron-dynamic"]})) == ""
    # ZeRO-3's seeds, one name per token cap, are counted together on the line (each cap stays in the JSON)
    caps = [dataclasses.replace(OWN_PLAN, extra={"seeded_from": f"megatron-dynamic@cap{n}"}) for n in (100, 200)]
    runs["dcp"] = run("dcp", caps + [SEEDED, OWN_PLAN], [2.0, 2.0, 1.5, 2.0])
    line = format_origins(summarize(runs))
    assert "seeded 3 (" in line and "megatron-dynamic x1, megatron-dynamic@cap* x2" in line, line


def test_zero3_seed_names_are_one_token():
    """ZeRO-3's seeds (dev's layout at a wave count's cap) are named `megatron-dynamic@cap<N>`: the label stays the
    seed's own name, not a squeezed phrase."""
    import math
    import re

    from dcp_megatron.planner.layout import check_batch
    from dcp_megatron.planner.dcp.lockstep_seeds import lockstep_seeds
    from tests.unit.test_zero3_relief import _run

    cost, batches, max_seq_len = _run("lognormal", 8, 262144, steps=1)
    names = [name for name, _ in lockstep_seeds(*check_batch(batches[0].sequences), cost, math.inf, max_seq_len)]
    assert names and all(re.fullmatch(r"megatron-dynamic@cap\d+", name) for name in names), names
