"""Online refinement of the cost model: factors follow measured / predicted, scaled cost models."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_megatron.planner.costmodel import CostModel, cluster_preset, model_preset
from dcp_megatron.planner.plan import NO_RECOMPUTE, SELECTIVE, Group, MicroBatch, Recompute, StepPlan, Wave
from dcp_megatron.planner.policies import make_plan
from dcp_megatron.planner.costmodel.refine import MeasuredMicroBatch, TimeCorrection, plan_buckets, relative_error
from dcp_megatron.core.plan_log import _factors_text

COST = CostModel(model_preset("llama3-8b"), cluster_preset("h200", domain_size=8))


def test_factors_reach_a_constant_true_ratio_in_a_few_steps_and_untouched_buckets_stay_out():
    correction = TimeCorrection(smoothing=0.5)
    true = {(1, "none"): 2.0, (2, "full4"): 0.5}
    buckets = [(c, r) for c in (1, 2, 4) for r in ("none", "mlp", "full4")]
    noise = [1.1, 0.9, 1.05, 0.95, 1.0, 1.0]
    for wobble in noise:
        measured = [MeasuredMicroBatch(cp, relief, predicted_s=0.1, measured_s=0.1 * ratio * wobble)
                    for (cp, relief), ratio in true.items()]
        factors = correction.update(correction.bucket_sums(measured, buckets), buckets)
    assert set(factors) == set(true)
    for bucket, ratio in true.items():
        assert factors[bucket] == pytest.approx(ratio, rel=0.05)
    assert correction.steps == len(noise)


def test_bucket_sums_add_per_bucket_and_updates_are_deterministic():
    correction = TimeCorrection()
    buckets = [(c, r) for c in (1, 2) for r in ("none", "selective", "mlp")]
    measured = [MeasuredMicroBatch(1, "none", 0.2, 0.3), MeasuredMicroBatch(1, "none", 0.1, 0.3),
                MeasuredMicroBatch(2, "selective", 0.5, 0.25)]
    sums = correction.bucket_sums(measured, buckets)
    assert len(sums) == 2 * len(buckets) == 12
    assert sums[0:2] == pytest.approx([0.3, 0.6]) and sums[2 * 4:2 * 4 + 2] == pytest.approx([0.5, 0.25])
    other = TimeCorrection()
    first = correction.update(sums, buckets)
    assert first == other.update(list(sums), buckets)             # the same sums give the same factors
    assert first == pytest.approx({(1, "none"): 2.0, (2, "selective"): 0.5})
    assert correction.update([0.0] * 12, buckets) == first         # nothing measured: nothing moves
    with pytest.raises(ValueError, match="no bucket"):
        correction.bucket_sums([MeasuredMicroBatch(3, "none", 1.0, 1.0)], buckets)
    with pytest.raises(ValueError, match="expected 12 sums"):
        correction.update([1.0], buckets)
    with pytest.raises(ValueError, match="smoothing"):
        TimeCorrection(smoothing=0)
    assert relative_error(1.5, 1.0) == pytest.approx(0.5) and math.isinf(relative_error(1.0, 0.0))


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 65_536), min_size=1, max_size=6), cp_size=st.sampled_from([1, 2, 4]),
       factor=st.floats(0.2, 5.0), kind=st.sampled_from(["none", "selective", "mlp", "full4"]))
def test_scaled_cost_model_multiplies_exactly_that_buckets_micro_batch_times(lengths, cp_size, factor, kind):
    recompute = {"none": NO_RECOMPUTE, "selective": SELECTIVE, "mlp": Recompute.of_modules({"mlp"}),
                 "full4": Recompute("full", 4)}[kind]
    scaled = COST.with_time_scale({(cp_size, kind): factor})
    base_t = COST.microbatch_time(lengths, cp_size, recompute=recompute)
    assert scaled.microbatch_time(lengths, cp_size, recompute=recompute) == pytest.approx(factor * base_t, rel=1e-12)
    other_kind = NO_RECOMPUTE if kind != "none" else SELECTIVE
    assert (scaled.microbatch_time(lengths, cp_size, recompute=other_kind)
            == COST.microbatch_time(lengths, cp_size, recompute=other_kind))
    # the vectorised path agrees with the scalar one
    local, compute, attn = (np.array([x]) for x in scaled._sums(lengths, cp_size))
    vector = scaled.times_from_sums(local, compute, attn, cp_size, np.array([0]), recompute)
    assert float(vector[0]) == pytest.approx(scaled.microbatch_time(lengths, cp_size, recompute=recompute), rel=1e-12)


def test_plans_follow_the_corrections():
    """Micro-batches measured 3x slower: the plan's estimate rises, and it stays a valid plan."""
    batch = [(i, n) for i, n in enumerate([131_072, 65_536, 8192, 4096] * 4)]
    plain = make_plan("dcp", batch, COST, max_seq_len=131_072)
    # every size slower (dcp's best plan here runs all on one CP-8 group: CP 1 alone would not touch it)
    corrected = make_plan("dcp", batch, COST.with_time_scale({(c, str(r)): 3.0 for c in (1, 2, 4, 8)
                                                              for r in COST.recompute_options()}),
                          max_seq_len=131_072)
    assert corrected.est_step_time_s > plain.est_step_time_s
    with pytest.raises(ValueError, match="positive and finite"):
        COST.with_time_scale({(1, "none"): float("nan")})


def test_buckets_name_the_relief_that_ran_and_its_factor_scales_only_that_relief():
    """A step whose micro-batches ran MLP recompute is bucketed, logged and corrected as `mlp`, not `selective`
    (megatron-core's granularity, which core attention alone also has)."""
    mlp, both = Recompute.of_modules({"mlp"}), Recompute.of_modules({"core_attn", "mlp"})
    lengths = [4096, 2048]
    groups = (Group(0, 2, (MicroBatch(((0, 4096),), recompute=mlp), MicroBatch(((1, 2048),)))),
              Group(2, 1, (MicroBatch(((2, 4096),), recompute=both), MicroBatch(((3, 8),), recompute=Recompute("full", 2)),
                           MicroBatch((), recompute=SELECTIVE))))   # empty: ran nothing, no bucket
    plan = StepPlan(domain_size=3, waves=(Wave(groups),))
    buckets = plan_buckets(plan)
    assert buckets == [(1, "core_attn+mlp"), (1, "full2"), (2, "mlp"), (2, "none")]
    measured = [MeasuredMicroBatch(2, "mlp", 0.1, 0.2), MeasuredMicroBatch(2, "none", 0.1, 0.1)]
    correction = TimeCorrection(smoothing=1.0)
    factors = correction.update(correction.bucket_sums(measured, buckets), buckets)
    assert factors == pytest.approx({(2, "mlp"): 2.0, (2, "none"): 1.0})
    assert _factors_text(factors) == ", measured corrections cp2/mlp x2.00, cp2/none x1.00"
    refined = COST.with_time_scale(factors)
    for relief, ratio in ((mlp, 2.0), (NO_RECOMPUTE, 1.0), (SELECTIVE, 1.0), (both, 1.0)):
        assert refined.microbatch_time(lengths, 2, recompute=relief) == pytest.approx(
            ratio * COST.microbatch_time(lengths, 2, recompute=relief), rel=1e-12), relief
