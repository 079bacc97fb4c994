"""The baselines' run-wide settings and their sweep (planner/baselines/sweep.py), on small cases worked by hand.

tiny_cost(2) (gpt-tiny, 4 layers, 2 ranks, CP at most 2): at most 2,427 local tokens per rank without recompute,
2,435 with selective, 2,974 / 3,876 / 5,565 / 6,865 with full recompute of 1 / 2 / 3 / 4
layers; 1e-4 s per micro-batch (test_the_memory_figures_this_file_works_from pins them).
"""
import pytest

from dcp_megatron.planner.baselines.sweep import dynamic_grid, grid_of, static_grid, sweep, token_caps
from dcp_megatron.planner.plan import NO_RECOMPUTE, SELECTIVE, Recompute
from dcp_megatron.planner.policies import make_plan
from dcp_megatron.planner.baselines.settings import DynamicSetting, StaticSetting, default_dynamic_setting
from dcp_megatron.planner.validate import validate
from dcp_megatron.simulate import SimulationConfig, simulate
from tests.support.planner_helpers import tiny_cost

FULL2, FULL3, FULL4 = Recompute("full", 2), Recompute("full", 3), Recompute("full", 4)


def _recomputes(plan) -> set[str]:
    return {str(mb.recompute) for w in plan.waves for g in w.groups for mb in g.microbatches if mb.sequences}


def test_the_winner_has_the_lowest_mean_not_the_best_first_step():
    """Step times by hand: A 1 + 5 (mean 3, best on batch 0), B 2 + 2 (mean 2), C 4 on batch 0 (passes B's
    total 4 -> stopped), D cannot run. B wins; ties would keep the earlier point."""
    a, b, c, d = (StaticSetting(cp_size=s, recompute=NO_RECOMPUTE) for s in (1, 2, 3, 4))
    times = {a: [1.0, 5.0], b: [2.0, 2.0], c: [4.5, 0.0]}

    def score(j, setting):
        if setting == d:
            raise ValueError("does not fit")
        return times[setting][j]

    result = sweep("static", [[(0, 1)], [(1, 1)]], tiny_cost(2), max_seq_len=1, grid=[a, b, c, d], score=score)
    assert result.winner == b and result.winner_mean_step_s == 2.0
    assert [p.mean_step_s for p in result.points] == [3.0, 2.0, None, None]
    assert "stopped after 1 of 2" in result.points[2].note and "cannot run: does not fit" in result.points[3].note
    tie = sweep("static", [[(0, 1)]], tiny_cost(2), max_seq_len=1, grid=[a, b], score=lambda j, s: 1.0)
    assert tie.winner == a


def test_a_larger_cap_wins_by_one_microbatch_when_it_needs_no_recompute():
    """Four 1,000-token documents on 2 ranks. Cap 1,000: one per rank per micro-batch, 2 micro-batches;
    cap 2,000: two per rank in one (workload 2e6 <= 1.05 x 1,000 x 2,000), same compute: one overhead less."""
    cost = tiny_cost(2)
    batch = [(i, 1000) for i in range(4)]
    small, large = (DynamicSetting(token_cap=cap, recompute=NO_RECOMPUTE) for cap in (1000, 2000))
    result = sweep("megatron-dynamic", [batch], cost, max_seq_len=1000, grid=[small, large])
    assert result.winner == large
    slow, fast = (p.mean_step_s for p in result.points)
    assert slow - fast == pytest.approx(cost.cluster.microbatch_overhead_s, rel=1e-6)
    assert [len(make_plan("megatron-dynamic", batch, cost, max_seq_len=1000, setting=s).waves)
            for s in (small, large)] == [2, 1]


def test_a_cap_that_needs_recompute_pays_it_on_every_microbatch_and_loses():
    """Four 2,000-token documents on 2 ranks. Cap 2,427 without recompute: 2 micro-batches of one document per
    rank. Cap 6,865 holds two per rank (4,000) in one micro-batch with full recompute of all 4 layers, which
    adds 1/3 of the compute: far more than the one micro-batch overhead it saves. A cap whose recompute does
    not fit it cannot run."""
    cost = tiny_cost(2)
    batch = [(i, 2000) for i in range(4)]
    none_cap = DynamicSetting(token_cap=cost.max_local_tokens(NO_RECOMPUTE), recompute=NO_RECOMPUTE)
    full_cap = DynamicSetting(token_cap=cost.max_local_tokens(FULL4), recompute=FULL4)
    too_big = DynamicSetting(token_cap=cost.max_local_tokens(FULL4), recompute=NO_RECOMPUTE)
    assert (none_cap.token_cap, full_cap.token_cap) == (2427, 6865)
    result = sweep("megatron-dynamic", [batch], cost, max_seq_len=2000, grid=[full_cap, none_cap, too_big])
    assert result.winner == none_cap
    assert "cannot run" in result.points[2].note and "does not fit" in result.points[2].note
    plan = make_plan("megatron-dynamic", batch, cost, max_seq_len=2000, setting=full_cap)
    validate(plan, batch, cost.cluster, cost)
    assert len(plan.waves) == 1 and _recomputes(plan) == {"full4"}


def test_the_run_wide_recompute_is_paid_by_light_microbatches_too():
    """Recompute is one setting for the run: a step whose micro-batches would fit without it still pays it
    (per-step choice would pick none here), in both dynamic schedulers."""
    cost = tiny_cost(2)
    batch = [(i, 100) for i in range(6)]
    setting = DynamicSetting(token_cap=3936, recompute=FULL3)
    for policy in ("megatron-dynamic", "megatron-hybrid"):
        plan = make_plan(policy, batch, cost, max_seq_len=4000, setting=setting)
        validate(plan, batch, cost.cluster, cost)
        assert _recomputes(plan) == {"full3"}, policy


def test_the_default_cap_comes_from_memory_not_from_the_static_layout():
    """Untuned, megatron-dynamic's cap is the most tokens memory holds with the least recompute that holds the
    run's longest sequence on the largest CP size (2): 3,000 tokens -> 1,500 per rank -> none, cap 2,427;
    6,000 -> 3,000 per rank -> full 2 (cap 3,876). The static layout (CP 2, capacity 1,500 / 3,000) plays no part."""
    cost = tiny_cost(2)
    assert default_dynamic_setting(cost, 3000, [1, 2]) == DynamicSetting(token_cap=2427, recompute=NO_RECOMPUTE)
    assert default_dynamic_setting(cost, 6000, [1, 2]) == DynamicSetting(token_cap=3876, recompute=FULL2)
    batch = [(0, 3000), (1, 1000), (2, 900)]
    plan = make_plan("megatron-dynamic", batch, cost, max_seq_len=3000)
    tuned = make_plan("megatron-dynamic", batch, cost, max_seq_len=3000, setting=DynamicSetting(
        token_cap=2427, recompute=NO_RECOMPUTE))
    assert plan.dumps() == tuned.dumps() and _recomputes(plan) == {"none"}


def test_grids_hold_what_a_user_would_try():
    cost = tiny_cost(2)
    # static, max_seq_len 4,000: CP 1 holds 4,000 per rank only with full 3 or more; CP 2 holds 2,000 with none or selective
    assert static_grid(cost, 4000) == [StaticSetting(cp_size=1, recompute=FULL3),
                                       StaticSetting(cp_size=2, recompute=NO_RECOMPUTE),
                                       StaticSetting(cp_size=2, recompute=SELECTIVE)]
    # caps: 256 x 2^(k/2) rounded to 256 (..., 2,816, 4,096, 5,888), plus the most none (2,427), selective
    # (2,435) and full 2, 3, 4 (3,876, 5,565, 6,865: full 2 is the fewest holding 3,000) hold, from the longest
    # sequence's share of CP 2 (3,000) up to 6,865
    assert token_caps(cost, 6000, 2) == [3876, 4096, 5565, 5888, 6865]
    assert default_dynamic_setting(cost, 6000, [1, 2]) in grid_of("megatron-dynamic", cost, 6000)
    grid = dynamic_grid(cost, 6000)
    assert {s.min_cp_size for s in grid} == {1, 2}
    assert DynamicSetting(token_cap=5565, recompute=FULL3) in grid      # the fewest full layers holding 5,565
    assert DynamicSetting(token_cap=5565, recompute=FULL4) not in grid  # more layers: only slower
    assert all(cost.memory_from_tokens(s.token_cap, s.recompute) <= cost.cluster.mem_budget_bytes for s in grid)
    with pytest.raises(ValueError, match="takes a DynamicSetting"):
        make_plan("megatron-dynamic", [(0, 10)], cost, max_seq_len=10, setting=StaticSetting(cp_size=1,
                                                                                              recompute=NO_RECOMPUTE))


def test_the_simulator_runs_each_baseline_at_its_swept_winner():
    """The simulator's baselines run at the sweep's winner (their mean step is the winner's), which is never
    slower than their untuned default (the default is a point of the grid), and here faster."""
    config = dict(lengths="builtin:wikipedia", model="gpt-tiny", cluster="cpu", gpus=2, tokens_per_step=8192,
                  steps=3, max_seq_len=2048, overlong="truncate",
                  policies=("static", "megatron-hybrid", "megatron-dynamic", "dcp"))
    tuned, _ = simulate(SimulationConfig(**config))
    untuned, _ = simulate(SimulationConfig(**config, tune_baselines=False))
    assert set(tuned.sweeps) == {"static", "megatron-hybrid", "megatron-dynamic"} and not untuned.sweeps
    report, plain = tuned.to_json()["policies"], untuned.to_json()["policies"]
    for name, result in tuned.sweeps.items():
        assert report[name]["mean_step_s"] == pytest.approx(result.winner_mean_step_s, rel=1e-9), name
        assert report[name]["mean_step_s"] <= plain[name]["mean_step_s"] * (1 + 1e-9), name
    # here the dynamic schedulers' defaults are not their winners: tuning shows
    assert report["megatron-dynamic"]["mean_step_s"] < plain["megatron-dynamic"]["mean_step_s"] * (1 - 1e-3)
    assert report["dcp"]["mean_step_s"] == plain["dcp"]["mean_step_s"]      # dcp is never tuned


def test_the_memory_figures_this_file_works_from():
    """The per-rank token capacities the module docstring states (the cases above are worked from them), and the
    TE spec's count they come from (memory_spec.py, bf16, gpt-tiny: h 128, 4 heads of 32, 2 KV heads, f 384)."""
    cost = tiny_cost(2)
    caps = {str(r): cost.max_local_tokens(r) for r in (NO_RECOMPUTE, SELECTIVE, Recompute("full", 1), FULL2, FULL3,
                                                       FULL4)}
    assert caps == {"none": 2427, "selective": 2435, "full1": 2974, "full2": 3876, "full3": 5565, "full4": 6865}, caps
    # a layer: two norms' input and 1/rms (2 x 128 + 4) and outputs (2 x 128), q k v 2(128 + 64 + 64), the output
    # 2 x 128, the LSE 4 x 4 heads, fc1's output 2 x 2 x 384, fc2's input 2 x 384
    layer = 2 * 260 + 2 * 256 + 512 + 256 + 16 + 1536 + 768
    # the loss: logits and their fp32 copy 6 x 512; the final norm, its output and the decoder's input, the labels
    # and the loss; a layer's backward: fc1's output's and the layer's input and output gradients
    output, grad = 6 * 512 + 260 + 2 * 256 + 8 + 4, 2 * (2 * 384 + 2 * 128)

    def full(k):   # k layer inputs and the fp32 RoPE table; the first layer rerun whole last, beside its gradients
        return max((4 - k) * layer + 256 * k + 4 * 32 + output, 256 * k + layer + grad)
    per_token = {"none": 4 * layer + output, "selective": 4 * (layer - 16) + output,
                 **{f"full{k}": full(k) for k in range(1, 5)}}
    room = cost.cluster.mem_budget_bytes - cost.static_bytes
    assert caps == {name: int(room // b) for name, b in per_token.items()}
    assert cost.cluster.microbatch_overhead_s == 1e-4
