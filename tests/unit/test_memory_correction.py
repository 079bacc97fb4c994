"""The memory correction: raised at once, lowered only after repeated readings and never below the floor, the same
on every rank, and plans made with the corrected count."""
import pytest

from dcp_megatron.planner.costmodel import CostModel, cluster_preset, model_preset
from dcp_megatron.planner.costmodel.memory_correction import (MEMORY_FLOOR, NO_MEMORY_SCALE, MemoryCorrection,
                                                              MemoryReading, MemoryScale, describe_scale,
                                                              relief_buckets)
from dcp_megatron.planner.plan import NO_RECOMPUTE, Group, MicroBatch, Recompute, StepPlan, Wave
from dcp_megatron.planner.policies import make_plan

COST = CostModel(model_preset("llama3-8b"), cluster_preset("h200", domain_size=8))
MLP = Recompute.of_modules({"mlp"})


def test_a_higher_reading_takes_effect_at_once_with_the_margin():
    correction = MemoryCorrection(margin=0.05)
    scale = correction.update([1.3, 0.0], ["none", "mlp"])      # 0: mlp had no reading this step
    assert scale.factors == pytest.approx({"none": 1.3 * 1.05})
    assert scale.of("mlp") == pytest.approx(1.3 * 1.05)          # unmeasured reliefs take the largest factor above 1
    assert correction.update([1.5], ["none"]).of("none") == pytest.approx(1.5 * 1.05)


def test_a_lower_reading_waits_for_several_updates_and_stops_at_the_floor():
    correction = MemoryCorrection(margin=0.0, floor=0.8, lower_after=3)
    assert correction.update([0.5], ["none"]).of("none") == 1.0      # one low reading: not applied
    assert correction.update([0.6], ["none"]).of("none") == 1.0
    assert correction.update([1.2], ["none"]).of("none") == pytest.approx(1.2)   # a high one resets the run
    for ratio in (0.5, 0.6):
        assert correction.update([ratio], ["none"]).of("none") == pytest.approx(1.2)
    scale = correction.update([0.7], ["none"])
    assert scale.of("none") == pytest.approx(0.8)                   # the highest of the run, not below the floor
    assert scale.default == 1.0                                      # a low factor never loosens unmeasured reliefs
    assert MEMORY_FLOOR == 0.8


def test_the_step_ratio_is_the_worst_micro_batch_and_ranks_folding_the_same_maxima_agree():
    buckets = ["mlp", "none"]
    ranks = [[MemoryReading("none", 100.0, 110.0), MemoryReading("none", 100.0, 90.0)],
             [MemoryReading("none", 100.0, 125.0), MemoryReading("mlp", 50.0, 40.0),
              MemoryReading("mlp", 1.0, 50.0)]]      # counted below min_counted_bytes: ignored
    per_rank = [MemoryCorrection(min_counted_bytes=10.0).bucket_ratios(r, buckets) for r in ranks]
    assert per_rank == [[0.0, pytest.approx(1.1)], [pytest.approx(0.8), pytest.approx(1.25)]]
    reduced = [max(column) for column in zip(*per_rank)]            # what the MAX all-reduce hands every rank
    first, second = MemoryCorrection(), MemoryCorrection()
    assert first.update(reduced, buckets) == second.update(list(reduced), buckets)
    assert first.factors == pytest.approx({"none": 1.25 * 1.05})
    with pytest.raises(ValueError, match="no bucket"):
        first.bucket_ratios([MemoryReading("full2", 1.0, 1.0)], buckets)
    with pytest.raises(ValueError, match="expected 2 ratios"):
        first.update([1.0], buckets)
    with pytest.raises(ValueError, match="floor"):
        MemoryCorrection(floor=0.0)


def test_buckets_are_the_plans_reliefs_and_the_log_names_the_factors_and_margin():
    plan = StepPlan(domain_size=2, waves=(Wave((Group(0, 1, (MicroBatch(((0, 64),), recompute=MLP),
                                                             MicroBatch((), recompute=Recompute("full", 2)))),
                                                Group(1, 1, (MicroBatch(((1, 32),)),)))),))
    assert relief_buckets(plan) == ["mlp", "none"]
    assert (describe_scale(MemoryScale({"none": 1.3, "mlp": 1.05}, 1.3), 0.05, 2)
            == "memory x1.05 (mlp), x1.30 (none), others x1.30, margin 5%, 2 updates")
    assert describe_scale(NO_MEMORY_SCALE, 0.05, 0) == "memory as counted, others x1.00, margin 5%, 0 updates"


def test_the_scale_multiplies_the_activation_bytes_of_its_relief_only():
    lengths = [8192, 4096]
    scaled = COST.with_memory_scale(MemoryScale({"mlp": 2.0}))
    for relief, factor in ((MLP, 2.0), (NO_RECOMPUTE, 1.0)):
        active = COST.microbatch_memory(lengths, 1, recompute=relief) - COST.static_bytes
        assert scaled.microbatch_memory(lengths, 1, recompute=relief) - scaled.static_bytes == pytest.approx(
            factor * active, abs=2)
    assert scaled.static_bytes == COST.static_bytes
    # time scales and memory scales travel together
    both = scaled.with_time_scale({(1, "none"): 2.0})
    assert both.memory_scale == scaled.memory_scale
    assert both.with_memory_scale(NO_MEMORY_SCALE).time_scale == {(1, "none"): 2.0}
    with pytest.raises(ValueError, match="positive and finite"):
        MemoryScale({"none": 0.0})


def test_a_count_found_low_makes_the_plan_take_more_relief_or_bigger_groups():
    """Measured at twice the count, every micro-batch is planned to fit the doubled count, which the plan made
    with the uncorrected count does not."""
    batch = [(i, n) for i, n in enumerate([131_072, 65_536, 32_768, 16_384, 8192, 4096] * 4)]
    doubled = COST.with_memory_scale(MemoryScale({}, default=2.0))
    plain = make_plan("dcp", batch, COST, max_seq_len=131_072)
    corrected = make_plan("dcp", batch, doubled, max_seq_len=131_072)
    budget = COST.cluster.mem_budget_bytes

    def worst(plan, cost):
        return max(cost.microbatch_memory(mb.lengths, group.size, recompute=mb.recompute)
                   for wave in plan.waves for group in wave.groups for mb in group.microbatches if mb.sequences)

    assert worst(plain, doubled) > budget >= worst(corrected, doubled)
    assert corrected.est_step_time_s > plain.est_step_time_s       # the relief or the bigger groups cost time


def test_a_probe_of_a_deliberately_halved_count_corrects_it_upward():
    """The planner counts half of what runs (COST's count halved); a probe of each relief's largest micro-batch
    measures the true bytes: the corrected plan takes more relief or bigger CP groups, and fits the true count."""
    from dcp_megatron.runtime.measured_memory import PEAK, counted_bytes
    from dcp_megatron.training.memory_probe_run import probe_lengths, probe_reliefs

    halved = COST.with_memory_scale(MemoryScale({}, default=0.5))
    correction = MemoryCorrection()
    reliefs = probe_reliefs(halved)
    readings = []
    for relief in reliefs:
        lengths = probe_lengths(halved.max_local_tokens(relief), 131_072)
        readings.append(MemoryReading(str(relief), counted_bytes(halved, lengths, 1, relief, PEAK),
                                      measured_bytes=counted_bytes(COST, lengths, 1, relief, PEAK)))
    buckets = sorted(str(r) for r in reliefs)
    scale = correction.update(correction.bucket_ratios(readings, buckets), buckets)
    assert all(factor == pytest.approx(2 * 1.05) for factor in scale.factors.values())
    corrected = halved.with_memory_scale(scale)
    batch = [(i, n) for i, n in enumerate([131_072, 65_536, 32_768, 16_384, 8192, 4096] * 4)]
    before = make_plan("dcp", batch, halved, max_seq_len=131_072)
    after = make_plan("dcp", batch, corrected, max_seq_len=131_072)

    def relief_and_groups(plan):
        mbs = [(group.size, mb) for wave in plan.waves for group in wave.groups for mb in group.microbatches
               if mb.sequences]
        return (sum(COST.bytes_per_local_token(NO_RECOMPUTE) - COST.bytes_per_local_token(mb.recompute)
                    for _, mb in mbs) / len(mbs), max(size for size, _ in mbs),
                max(COST.microbatch_memory(mb.lengths, size, recompute=mb.recompute) for size, mb in mbs))

    freed_before, largest_before, worst_before = relief_and_groups(before)
    freed_after, largest_after, worst_after = relief_and_groups(after)
    assert freed_after > freed_before or largest_after > largest_before
    assert worst_before > COST.cluster.mem_budget_bytes >= worst_after      # the true count: only the corrected fits


def test_a_short_micro_batch_dominated_by_fixed_costs_does_not_inflate_the_factor():
    """The noise guard: readings = a fixed cost (gradient buffers, workspaces) + the true bytes, the count 1% low.
    The short micro-batch's measured / counted is ~11 (its fixed cost dominates); left out below the floor, the
    factor is the long ones' (~1.01 x margin), and a --seq-length document still fits the corrected count."""
    import dataclasses

    from dcp_megatron.config import DcpConfig
    from dcp_megatron.core.planning import check_longest_fits
    from dcp_megatron.planner.costmodel.memory_correction import NOISE_SHARE, noise_floor_bytes

    cost = CostModel(model_preset("llama3-8b"), dataclasses.replace(cluster_preset("h200", domain_size=8),
                                                                    mem_bytes_per_gpu=80 * 2 ** 30))
    room = cost.cluster.mem_budget_bytes - cost.static_bytes
    floor = noise_floor_bytes(cost)
    assert floor == pytest.approx(NOISE_SHARE * room)
    fixed = 0.05 * room

    def reading(counted):
        return MemoryReading("none", counted_bytes=counted, measured_bytes=fixed + 1.01 * counted)

    readings = [reading(0.005 * room), reading(0.5 * room), reading(0.9 * room)]
    guarded, unguarded = MemoryCorrection(min_counted_bytes=floor), MemoryCorrection()
    for correction in (guarded, unguarded):
        correction.update(correction.bucket_ratios(readings, ["none"]), ["none"])
    assert unguarded.factors["none"] > 10       # what the unguarded correction did: every plan ~10x too small
    assert guarded.factors["none"] == pytest.approx((fixed + 1.01 * 0.5 * room) / (0.5 * room) * 1.05)
    assert guarded.factors["none"] < 1.2
    config = DcpConfig(seq_length=32768)
    check_longest_fits(config, cost.with_memory_scale(guarded.scale()))    # a healthy run goes on
    with pytest.raises(ValueError, match="fits no CP group"):
        check_longest_fits(config, cost.with_memory_scale(unguarded.scale()))


def test_cpu_readings_are_compared_with_the_count_at_their_own_cp_size():
    """Our CPU attention keeps per-CP-group tensors (memory_spec.CPU_FP32): a reading of a CP-2 micro-batch is
    compared with the CP-2 count, not the CP-1 one."""
    import dataclasses

    from dcp_megatron.planner.costmodel.memory_spec import CPU_FP32
    from dcp_megatron.planner.plan import NO_RECOMPUTE
    from dcp_megatron.runtime.measured_memory import PEAK, SAVED, counted_bytes

    shape = dataclasses.replace(model_preset("llama3-8b"), activations=CPU_FP32)
    cost = CostModel(shape, cluster_preset("cpu", domain_size=4))
    lengths = [400, 200]
    local = sum(length // 2 for length in lengths)      # each even length split over 2 ranks
    assert counted_bytes(cost, lengths, 2, NO_RECOMPUTE, SAVED) == local * cost.held_bytes_per_local_token(
        NO_RECOMPUTE, 2)
    assert counted_bytes(cost, lengths, 2, NO_RECOMPUTE, PEAK) == local * cost.bytes_per_local_token(NO_RECOMPUTE, 2)
    assert cost.held_bytes_per_local_token(NO_RECOMPUTE, 2) != cost.held_bytes_per_local_token(NO_RECOMPUTE, 1)


def test_the_noise_floor_compares_the_micro_batchs_packed_count_not_the_quantity_read():
    """A CPU reading is the bytes saved for backward; under full recompute that is a small share of the count the
    micro-batch was packed to. The floor looks at the packed count: a full micro-batch's reading is used however
    little it holds, a short one's is left out whatever it measured."""
    floor = 100.0
    correction = MemoryCorrection(min_counted_bytes=floor)
    full = MemoryReading("full2", counted_bytes=10.0, measured_bytes=13.0, packed_bytes=400.0)   # fills the room
    short = MemoryReading("none", counted_bytes=60.0, measured_bytes=600.0, packed_bytes=80.0)   # below the floor
    assert correction.bucket_ratios([full, short], ["full2", "none"]) == [pytest.approx(1.3), 0.0]
    assert MemoryCorrection().bucket_ratios([short], ["none"]) == [pytest.approx(10.0)]
