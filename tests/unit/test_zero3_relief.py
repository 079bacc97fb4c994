"""dcp under ZeRO-3 (`ModelShape.wave_uniform_relief`): one relief per wave that every micro-batch of it, an idle
rank's filler too, runs (what DeepSpeed's stage 3 can run); full-recompute packing rooms (fewer, fuller waves);
never slower than a tuned megatron-dynamic on small runs (dcp/lockstep_seeds.py); the DeepSpeed step's check
of a plan's waves (deepspeed/engine_step.check_wave_reliefs). Qwen2.5-32B on H200s, modelled."""
import dataclasses
import math

import pytest

from dcp_megatron.planner.baselines.sweep import sweep
from dcp_megatron.planner.costmodel import CostModel, cluster_preset, model_preset
from dcp_megatron.planner.plan import NO_RECOMPUTE, Group, MicroBatch, Recompute, StepPlan, Wave
from dcp_megatron.planner.policies import make_plan
from dcp_megatron.planner.layout import check_batch
from dcp_megatron.planner.dcp.own_layout import plan_dcp
from dcp_megatron.planner.validate import validate
from dcp_megatron.simulate import SimulationConfig, cut_batches


def _run(lengths: str, gpus: int, tokens: int, menu=None, steps: int = 3):
    """(cost model, batches, max_seq_len) of a small simulated ZeRO-3 run."""
    config = SimulationConfig(lengths=f"builtin:{lengths}", model="qwen2.5-32b", cluster="h200", gpus=gpus,
                              tokens_per_step=tokens, steps=steps, zero_stage=3, policies=("dcp",))
    model = dataclasses.replace(model_preset("qwen2.5-32b"), zero_stage=3)
    cluster = cluster_preset("h200", domain_size=gpus, gpus_per_node=min(gpus, 8))
    cost = CostModel(model, cluster, allowed_recompute=menu or config.recompute)
    batches, max_seq_len = cut_batches(config)
    return cost, batches, max_seq_len


def _wave_reliefs(waves) -> list[set]:
    return [{mb.recompute for g in w.groups for mb in g.microbatches} for w in waves]


def test_every_wave_runs_one_relief_fillers_included():
    """dcp's own waves and its final plans (seeded ones too): one relief per wave, an idle rank's filler included,
    and the reliefs differ between waves (each wave's own: the cheapest that holds its fullest micro-batch). Idle
    ranks: CP groups of at most 2 on 8 ranks, 11 sequences (the last wave leaves two ranks idle)."""
    cost, batches, max_seq_len = _run("prolong", 8, 262144)
    capped = CostModel(cost.model, dataclasses.replace(cost.cluster, max_cp_size=2),
                       allowed_recompute=cost.allowed_recompute)
    cases = [(cost, b.sequences) for b in batches] + [(capped, [(i, 12000 + 500 * i) for i in range(11)])]
    recomputed, relieved_fillers, per_wave = 0, 0, set()
    for model, batch in cases:
        ids, lengths = check_batch(batch)
        for waves in (plan_dcp(ids, lengths, model, max_seq_len=max_seq_len),
                      make_plan("dcp", batch, model, max_seq_len=max_seq_len).waves):
            reliefs = _wave_reliefs(waves)
            assert all(len(r) == 1 for r in reliefs), reliefs
            recomputed += sum(r != {NO_RECOMPUTE} for r in reliefs)
            per_wave.add(len({next(iter(r)) for r in reliefs}) > 1)
            relieved_fillers += sum(1 for w in waves for g in w.groups for mb in g.microbatches
                                    if not mb.sequences and mb.recompute != NO_RECOMPUTE)
    assert recomputed and relieved_fillers and True in per_wave, (recomputed, relieved_fillers, per_wave)


def test_a_baselines_wave_takes_one_relief_no_slower_than_its_run_wide_one():
    """A baseline's layout seeding dcp under ZeRO-3 gets one relief per wave (relief_pass.with_wave_reliefs), its
    fillers too, and no micro-batch slower than with the run-wide relief."""
    from dcp_megatron.planner.dcp.relief_pass import with_own_reliefs
    from dcp_megatron.planner.baselines.settings import DynamicSetting, least_recompute_for

    cost, batches, max_seq_len = _run("lognormal", 8, 262144)
    for cap in (4096, 8192, 16000):
        setting = DynamicSetting(token_cap=cap, recompute=least_recompute_for(cost, cap))
        plan = make_plan("megatron-dynamic", batches[0].sequences, cost, max_seq_len=max_seq_len, setting=setting)
        waves, changed = with_own_reliefs(plan.waves, cost)
        assert changed and all(len(r) == 1 for r in _wave_reliefs(waves)), (cap, _wave_reliefs(waves))
        assert any(r != {setting.recompute} for r in _wave_reliefs(waves))
        for old, new in zip(plan.waves, waves):
            for g_old, g_new in zip(old.groups, new.groups):
                for a, b in zip(g_old.microbatches, g_new.microbatches):
                    assert b.est_time_s <= a.est_time_s * (1 + 1e-12), (a, b)


def test_full_recompute_rooms_pack_fewer_fuller_waves():
    """With none and full on the menu, the room without relief would need `none_waves` waves; dcp's own plan packs
    fewer, fuller ones whose micro-batches share full recompute (dcp_waves._full_room_candidates)."""
    cost, batches, max_seq_len = _run("lognormal", 16, 524288, menu=("none", "full"), steps=2)
    for batch in batches:
        ids, lengths = check_batch(batch.sequences)
        waves = plan_dcp(ids, lengths, cost, max_seq_len=max_seq_len)
        local = float(cost.doc_terms(lengths, 1)[0].sum())
        none_waves = math.ceil(local / (16 * cost.max_local_tokens(NO_RECOMPUTE)))
        assert len(waves) < none_waves, (len(waves), none_waves)
        assert any(next(iter(r)).kind == "full" for r in _wave_reliefs(waves))


@pytest.mark.parametrize("lengths,gpus,tokens", [("lognormal", 8, 262144), ("prolong", 8, 262144),
                                                 ("wikipedia", 16, 524288)])
def test_never_slower_than_a_tuned_megatron_dynamic_on_any_batch(lengths, gpus, tokens):
    """The peer tuned over the run's batches (baseline_sweep: one cap, smallest CP size and recompute for the run)
    against dcp's plan of each batch, both scored by the same cost model."""
    cost, batches, max_seq_len = _run(lengths, gpus, tokens)
    tuned = sweep("megatron-dynamic", [b.sequences for b in batches], cost, max_seq_len=max_seq_len).winner
    for batch in batches:
        peer = make_plan("megatron-dynamic", batch.sequences, cost, max_seq_len=max_seq_len, setting=tuned)
        ours = make_plan("dcp", batch.sequences, cost, max_seq_len=max_seq_len)
        validate(ours, batch.sequences, cost.cluster, cost)
        assert ours.est_step_time_s <= peer.est_step_time_s * (1 + 1e-9), (batch.step, tuned, ours.extra,
                                                                           ours.est_step_time_s, peer.est_step_time_s)


def test_the_deepspeed_step_refuses_a_wave_whose_ranks_recompute_differently():
    from dcp_megatron.deepspeed.engine_step import check_wave_reliefs

    full = Recompute("full", 2)
    uniform = Wave((Group(0, 1, (MicroBatch(((0, 8),), full),)), Group(1, 1, (MicroBatch((), full),))))
    check_wave_reliefs(StepPlan(domain_size=2, waves=(uniform,)), 5)
    filler_differs = Wave((Group(0, 1, (MicroBatch(((1, 8),), full),)), Group(1, 1, (MicroBatch(()),))))
    with pytest.raises(RuntimeError, match="step 5, wave 1: its micro-batches recompute differently \\(full2, none\\)"):
        check_wave_reliefs(StepPlan(domain_size=2, waves=(uniform, filler_differs)), 5)


def test_an_idle_ranks_filler_runs_the_relief_its_plan_names():
    """The filler of an idle rank replays as its wave does (core/microbatches.build_batch): under ZeRO-3 its weight
    gathers must pair with its peers' recomputing ones."""
    import torch

    from dcp_megatron.core.microbatches import MICROBATCH_KEY, build_batch

    full = Recompute("full", 2)
    filler = build_batch([], cp_size=1, cp_rank=0, group=None, recompute=full, wave_index=3, device=torch.device("cpu"))
    assert filler[MICROBATCH_KEY].recompute == full and int(filler["loss_mask"].sum()) == 0


def test_a_seeded_waves_idle_filler_takes_the_waves_relief_and_validate_refuses_a_wave_that_mixes():
    """A baseline's wave with an idle rank: the relief pass gives the filler the relief its busy peers run
    (relief_pass.with_wave_reliefs), and `validate` refuses a ZeRO-3 plan whose filler kept its own."""
    from dcp_megatron.planner.layout import microbatch_from_sums
    from dcp_megatron.planner.dcp.relief_pass import with_own_reliefs
    from dcp_megatron.planner.validate import PlanError

    cost, _, _ = _run("lognormal", 8, 262144, steps=1)
    batch = [(0, 30000), (1, 8000)]
    run_wide = Recompute("full", cost.layers_per_stage)   # the baseline's, on every micro-batch of its wave

    def planned(sequence, size, first):   # a micro-batch with the baseline's relief and its modelled time
        return microbatch_from_sums(cost, (sequence,), *cost._sums([sequence[1]], size), size, first, run_wide)

    seeded = (Wave((Group(0, 4, (planned(batch[0], 4, 0),)), Group(4, 2, (planned(batch[1], 2, 4),)),
                    Group(6, 2, (MicroBatch((), run_wide),)))),)
    waves, changed = with_own_reliefs(seeded, cost)
    (relief,) = _wave_reliefs(waves)[0]
    # the premise: the wave's fullest micro-batch needs relief, a cheaper one than the baseline's
    assert changed and relief not in (NO_RECOMPUTE, run_wide), relief
    assert waves[0].groups[2].microbatches[0].recompute == relief
    validate(StepPlan(domain_size=8, waves=waves), batch, cost.cluster, cost)
    groups = waves[0].groups
    filler_kept_its_own = Wave((*groups[:2], Group(6, 2, (MicroBatch(()),))))
    with pytest.raises(PlanError, match=r"relief: wave 0 mixes .*idle fillers included"):
        validate(StepPlan(domain_size=8, waves=(filler_kept_its_own,)), batch, cost.cluster, cost)
