"""Single-process pieces of the runtime: per-token loss accounting, recompute switches, step stats,
the cpu cluster preset. The multi-rank proofs are in test_runtime_parity.py."""
import copy
from functools import partial

import pytest
import torch

from dcp_megatron.planner.costmodel import CostModel, cluster_preset, cpu_cluster, model_preset
from dcp_megatron.planner.plan import Group, MicroBatch, Recompute, StepPlan, Wave
from dcp_megatron.runtime.cp_attention import packed_causal_attention
from tests.support.reference.loss import IGNORE_INDEX, StepLoss, next_token_labels, reduce_step, token_loss_sum
from tests.support.reference.recompute import apply_recompute, current_recompute
from tests.support.reference.single_process import grad_max_rel_err
from tests.support.reference.stats import RankTimes, StepStats, imbalance, predicted_busy_s
from tests.support.reference.tiny_gpt import TinyGPT, TinyGPTConfig
from tests.support.tool_helpers import load_tool

CONFIG = TinyGPTConfig(vocab_size=32, num_layers=3, hidden_size=16, num_heads=4, num_kv_heads=2, ffn_hidden_size=24)


def _positions(lengths):
    return torch.cat([torch.arange(n) for n in lengths])


def _cu_seqlens(lengths):
    return torch.tensor([0] + list(lengths)).cumsum(0)


def test_next_token_labels_stop_at_document_ends():
    tokens = torch.tensor([10, 11, 12, 20, 30, 31])
    labels = next_token_labels(tokens, [3, 1, 2])
    assert labels.tolist() == [11, 12, IGNORE_INDEX, IGNORE_INDEX, 31, IGNORE_INDEX]
    with pytest.raises(ValueError, match="sum\\(doc_lengths\\)=5"):
        next_token_labels(tokens, [3, 2])


def test_token_loss_sum_ignores_padding_rows_and_matches_the_mean():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 5, generator=gen)
    labels = torch.tensor([1, IGNORE_INDEX, 3, 0, IGNORE_INDEX, 4, 2])
    loss_sum, count = token_loss_sum(logits, labels)
    keep = labels != IGNORE_INDEX
    assert count == 5
    assert torch.allclose(loss_sum / count, torch.nn.functional.cross_entropy(logits[keep], labels[keep]))
    only_padding = torch.full((3,), IGNORE_INDEX)
    empty_sum, empty_count = token_loss_sum(logits[:3].requires_grad_(), only_padding)
    assert empty_count == 0 and float(empty_sum.detach()) == 0.0 and empty_sum.requires_grad  # still joins backward


def test_per_token_loss_over_uneven_microbatches_equals_the_full_batch_mean():
    """Summing unscaled micro-batch losses and scaling once by the global count is the full-batch
    gradient; averaging per-micro-batch means is not (the bug this accounting prevents)."""
    batch_lengths = [[9, 2], [30], [4, 4, 5]]
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.randint(CONFIG.vocab_size, (sum(ls),), generator=gen) for ls in batch_lengths]
    model = TinyGPT(CONFIG, seed=3)
    reference, mean_of_means = copy.deepcopy(model), copy.deepcopy(model)

    def loss_of(m, toks, lengths):
        logits = m(toks, _positions(lengths), partial(packed_causal_attention, cu_seqlens=_cu_seqlens(lengths)))
        return token_loss_sum(logits, next_token_labels(toks, lengths))

    step = StepLoss()
    for toks, lengths in zip(tokens, batch_lengths):
        loss_sum, count = loss_of(model, toks, lengths)
        loss_sum.backward()
        step.add(loss_sum, count)
        s, c = loss_of(mean_of_means, toks, lengths)
        (s / c / len(batch_lengths)).backward()
    loss, num_tokens = reduce_step(model.parameters(), step, group=None)

    all_lengths = [n for ls in batch_lengths for n in ls]
    ref_sum, ref_count = loss_of(reference, torch.cat(tokens), all_lengths)
    (ref_sum / ref_count).backward()
    assert num_tokens == ref_count == sum(n - 1 for n in all_lengths)
    assert loss == pytest.approx(float(ref_sum.detach() / ref_count), rel=1e-6)
    assert grad_max_rel_err(model, reference) <= 1e-5
    assert grad_max_rel_err(mean_of_means, reference) > 1e-2


def test_reduce_step_rejects_a_step_without_label_tokens():
    model = TinyGPT(CONFIG)
    with pytest.raises(ValueError, match="no label tokens"):
        reduce_step(model.parameters(), StepLoss(), group=None)


def _count_attention_calls(model, recompute: Recompute) -> tuple[int, list[int]]:
    """(core attention calls, per-block MLP forward calls) over one forward + backward."""
    calls = {"attention": 0}
    block_calls = [0] * len(model.layers)
    hooks = [block.mlp.register_forward_pre_hook(lambda mod, args, i=i: block_calls.__setitem__(i, block_calls[i] + 1))
             for i, block in enumerate(model.layers)]
    lengths = [7, 5]
    cu = _cu_seqlens(lengths)

    def attention(q, k, v):
        calls["attention"] += 1
        return packed_causal_attention(q, k, v, cu)
    apply_recompute(model, recompute)
    tokens = torch.randint(CONFIG.vocab_size, (12,))
    model(tokens, _positions(lengths), attention).sum().backward()
    for hook in hooks:
        hook.remove()
    return calls["attention"], block_calls


def test_recompute_switches_change_what_backward_recomputes():
    model = TinyGPT(CONFIG)
    n = CONFIG.num_layers
    assert _count_attention_calls(model, Recompute("none")) == (n, [1] * n)
    attention_calls, blocks = _count_attention_calls(model, Recompute("selective"))
    assert attention_calls == 2 * n and blocks == [1] * n      # core attention replayed in backward
    attention_calls, blocks = _count_attention_calls(model, Recompute("full", 2))
    assert attention_calls == n + 2 and blocks == [2, 2, 1]    # the first two blocks replayed
    assert current_recompute(model) == Recompute("full", 2)
    apply_recompute(model, Recompute("selective"))
    assert current_recompute(model) == Recompute("selective")
    apply_recompute(model, Recompute("none"))
    assert current_recompute(model) == Recompute("none")
    with pytest.raises(ValueError, match="4 layers, the model has 3"):
        apply_recompute(model, Recompute("full", 4))


def test_stats_imbalance_and_prediction():
    assert imbalance([]) == 0.0 and imbalance([0.0, 0.0]) == 0.0
    assert imbalance([1.0, 1.0, 1.0]) == 0.0
    assert imbalance([4.0, 0.0]) == pytest.approx(0.5)
    mb = lambda t: MicroBatch(((0, 4),), est_time_s=t)  # noqa: E731
    plan = StepPlan(domain_size=3, waves=(Wave((Group(0, 2, (mb(1.0), mb(2.0))), Group(2, 1, (mb(0.5),)))),
                                          Wave((Group(0, 1, ()), Group(1, 2, (mb(1.0),))))),
                    est_step_time_s=4.0, policy="p")
    assert predicted_busy_s(plan) == [3.0, 4.0, 1.5]
    times = [RankTimes(domain_rank=r, num_microbatches=2, compute_s=c, wave_wait_s=(0.0, w), reduce_s=0.1, step_s=s)
             for r, c, w, s in ((0, 3.0, 0.0, 3.2), (1, 4.0, 0.0, 4.2), (2, 1.0, 2.0, 4.1))]
    assert RankTimes.from_tensor(times[2].to_tensor()) == times[2]
    stats = StepStats(ranks=tuple(times), predicted_busy_s=tuple(predicted_busy_s(plan)), predicted_step_s=4.0)
    assert stats.imbalance == pytest.approx((4.0 - 8.0 / 3) / 4.0)
    assert stats.predicted_imbalance == pytest.approx((4.0 - 8.5 / 3) / 4.0)
    assert stats.step_s == 4.2 and stats.wave_wait_s(1) == (0.0, 0.0, 2.0)
    assert "rank 2" in stats.summary() and stats.to_json()["ranks"][1]["predicted_busy_s"] == 4.0


def test_cpu_cluster_preset_needs_cp2_for_4k_token_documents():
    cluster = cpu_cluster(2)
    assert cluster.name == "cpu" and cluster.domain_size == 2 and cluster.same_node(0, 2)
    assert cluster_preset("cpu", domain_size=6).domain_size == 6
    cost = CostModel(model_preset("gpt-tiny"), cluster)
    assert cost.best_recompute([4096], 1) is None           # one rank cannot hold it, even with recompute
    assert cost.best_recompute([4096], 2) is not None
    assert cost.best_recompute([1024], 1) == Recompute("none")
    assert cost.microbatch_time([4096], 2) < cost.microbatch_time([4096], 1)
    with pytest.raises(ValueError, match="positive int"):
        cpu_cluster(0)


def test_check_parity_report_prints_max_rel_err_last_and_fails_above_tolerance(capsys):
    tool = load_tool("check_parity")
    assert tool.report([(3e-7, 1e-7, "a"), (8e-7, 2e-7, "b")]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "max_rel_err=8.000000e-07"
    assert tool.report([(3e-7, 1e-7, "a"), (2e-5, 1e-7, "b")]) == 1
    assert capsys.readouterr().out.strip().splitlines()[-1] == "max_rel_err=2.000000e-05"
    assert tool.report([(3e-7, 5e-5, "a")]) == 1   # a loss mismatch fails too
