"""Issue 46: a start refusal names the value that would work (planner/start_fit.py bisects the start check), and a
relief menu of offload alone is refused in one line rather than crashing the planner."""
from __future__ import annotations

import dataclasses

import pytest

from dcp_megatron.config import DcpConfig, DcpUsageError
from dcp_megatron.planner.costmodel import CostModel, GiB, cpu_cluster, model_preset
from dcp_megatron.planner.start_fit import (budget_gb_that_fits, longest_fits, smallest_domain_size,
                                            smallest_max_cp_size, smallest_memory_bytes)


def _cost(domain_size=4, budget_gb=0.02, recompute=("none", "full"), **cluster):
    base = dataclasses.replace(cpu_cluster(domain_size), mem_bytes_per_gpu=int(budget_gb * GiB), **cluster)
    return CostModel(model_preset("gpt-tiny"), base, allowed_recompute=recompute)


@pytest.mark.parametrize("recompute", [("none",), ("none", "full")])
@pytest.mark.parametrize("seq_length", [2048, 8192])
def test_the_named_budget_passes_the_start_check_and_a_bit_less_fails(recompute, seq_length):
    cost = _cost(budget_gb=0.005, recompute=recompute)
    assert not longest_fits(cost, seq_length)
    least = smallest_memory_bytes(cost, seq_length)
    assert longest_fits(cost.with_cluster(mem_bytes_per_gpu=least), seq_length)
    assert not longest_fits(cost.with_cluster(mem_bytes_per_gpu=least - 1), seq_length)
    named = budget_gb_that_fits(cost, seq_length)       # what the refusal prints, as --dcp-memory-budget-gb reads it
    assert longest_fits(cost.with_cluster(mem_bytes_per_gpu=int(named * GiB)), seq_length)
    assert not longest_fits(cost.with_cluster(mem_bytes_per_gpu=int(named * 0.99 * GiB)), seq_length)


def test_the_named_cp_size_and_domain_pass_the_start_check_and_one_less_fails():
    seq_length = 16384
    cost = _cost(domain_size=4, budget_gb=0.05, max_cp_size=1)
    assert not longest_fits(cost, seq_length)
    cp = smallest_max_cp_size(cost, seq_length)
    assert 1 < cp <= 4
    assert longest_fits(cost.with_cluster(max_cp_size=cp), seq_length)
    assert not longest_fits(cost.with_cluster(max_cp_size=cp - 1), seq_length)
    wide = cost.with_cluster(max_cp_size=0)          # up to the domain: more ranks make larger groups
    ranks = smallest_domain_size(wide.with_cluster(domain_size=2), seq_length)
    assert ranks > 2
    assert longest_fits(wide.with_cluster(domain_size=ranks), seq_length)
    assert not longest_fits(wide.with_cluster(domain_size=ranks - 1), seq_length)


def test_the_start_refusal_names_the_budget_cp_size_and_ranks_that_would_do():
    from dcp_megatron.core.planning import check_longest_fits

    seq_length = 16384
    config = DcpConfig(seq_length=seq_length, recompute=("none", "full"), memory_budget_gb=0.05, max_cp_size=1)
    cost = _cost(domain_size=4, budget_gb=0.05, max_cp_size=1)
    with pytest.raises(DcpUsageError) as err:
        check_longest_fits(config, cost)
    line = str(err.value)
    assert "\n" not in line
    assert f"raise --dcp-memory-budget-gb to at least {budget_gb_that_fits(cost, seq_length):g}" in line, line
    assert f"raise --dcp-max-cp-size to {smallest_max_cp_size(cost, seq_length)}" in line, line
    ranks = smallest_domain_size(cost, seq_length)
    assert (f"a DCP domain of {ranks}" in line) if ranks else "use more ranks" in line, line


def test_a_menu_of_offload_alone_is_refused_in_one_line(capsys):
    from dcp_megatron.simulate import main

    for extra in ([], ["--zero-stage", "3"]):
        assert main(["--lengths", "builtin:wikipedia", "--steps", "1", "--recompute", "offload", *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "leaves no relief to run" in err and "e.g. none,offload" in err, err
    with pytest.raises(ValueError, match="leaves no relief to run"):
        _cost(recompute=("offload",))


def test_a_microbatch_no_relief_holds_is_a_one_line_error_naming_its_documents_and_step():
    from dcp_megatron.planner.layout import microbatch_from_sums

    cost = _cost(budget_gb=0.02)
    sequences = ((7, 60000), (8, 40))
    with pytest.raises(ValueError) as err:
        microbatch_from_sums(cost, sequences, *cost._sums([60000, 40], 1), 1, 0)
    line = str(err.value)
    assert "\n" not in line and "documents [60000, 40]" in line and "--dcp-memory-budget-gb" in line, line

    from dcp_megatron.core.step_loop import _named_step

    def plan():
        microbatch_from_sums(cost, sequences, *cost._sums([60000, 40], 1), 1, 0)

    with pytest.raises(DcpUsageError, match=r"^iteration 3: no plan: a micro-batch of documents \[60000, 40\]"):
        _named_step(3, plan)
