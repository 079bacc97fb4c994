"""In-process tests of the DCP pieces of the megatron adapter: static plans from flags, domains,
per-rank micro-batches, the attention metadata, the RoPE-group patch and the log line."""
from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from dcp_megatron.data.documents import InMemoryDocuments  # noqa: E402
from dcp_megatron.megatron.domain import dcp_domains  # noqa: E402
from dcp_megatron.megatron.plan_microbatches import build_microbatch  # noqa: E402
from dcp_megatron.megatron.planning import static_cp_plan  # noqa: E402
from dcp_megatron.megatron.train_step import StepResult, format_log_line  # noqa: E402
from dcp_megatron.planner.batcher import GlobalBatch  # noqa: E402
from dcp_megatron.planner.cluster import cluster_preset  # noqa: E402
from dcp_megatron.planner.cost import CostModel  # noqa: E402
from dcp_megatron.planner.model import ModelShape  # noqa: E402
from dcp_megatron.planner.plan import NO_RECOMPUTE, SELECTIVE, MicroBatch, Recompute  # noqa: E402


def _cost(domain_size: int, pp: int = 1) -> CostModel:
    shape = ModelShape(num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                       ffn_hidden_size=256, vocab_size=512, pp=pp)
    return CostModel(shape, cluster_preset("cpu", domain_size=domain_size))


@pytest.mark.parametrize("domain_size, cp_size, pp", [(4, 2, 1), (4, 1, 1), (4, 2, 2), (6, 3, 1)])
def test_static_cp_plan_is_megatrons_layout(domain_size, cp_size, pp):
    lengths = [50, 60, 30, 128, 5, 7, 100, 90, 11, 64, 64]
    sequences = list(enumerate(lengths, start=100))
    plan = static_cp_plan(sequences, _cost(domain_size, pp), cp_size=cp_size, tokens_per_microbatch=128,
                          recompute=SELECTIVE)
    assert sorted(plan.sequences()) == sorted(sequences)             # every sequence exactly once
    groups = [g for w in plan.waves for g in w.groups]
    assert {g.size for g in groups} == {cp_size}
    assert all(g.first_rank % cp_size == 0 for g in groups)
    assert all(mb.num_tokens <= 128 and mb.recompute == SELECTIVE for g in groups for mb in g.microbatches)
    in_order = [s for w in plan.waves for g in w.groups for mb in g.microbatches for s in mb.sequences]
    assert plan.est_step_time_s > 0
    counts = [plan.num_microbatches(r) for r in range(domain_size)]
    if pp > 1:
        assert len(set(counts)) == 1                                  # 1F1B needs equal counts
        assert all(len(g.microbatches) == 1 for g in groups)
    else:
        assert max(counts) - min(counts) <= 1
        assert len(plan.waves) == 1 and sorted(in_order) == sorted(sequences)


def test_static_cp_plan_rejects_a_cp_size_that_does_not_tile_the_domain():
    with pytest.raises(ValueError, match="context-parallel size 4"):
        static_cp_plan([(0, 5)], _cost(6), cp_size=4, tokens_per_microbatch=128, recompute=NO_RECOMPUTE)


def test_dcp_domains_are_megatrons_data_parallel_groups():
    domains = dcp_domains(world_size=8, tp_size=2, pp_size=2)
    # tp-cp-ep-dp-pp order with CP 1: TP is innermost, PP outermost.
    assert domains == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert sorted(r for d in domains for r in d) == list(range(8))
    with pytest.raises(ValueError, match="not divisible"):
        dcp_domains(world_size=6, tp_size=4, pp_size=1)


def _corpus():
    docs = [list(range(10, 20)), list(range(50, 57)), list(range(80, 84))]
    source = InMemoryDocuments(docs)
    # Pieces: doc 0 positions 2..8 (7), doc 1 whole (6), doc 2 whole (3).
    batch = GlobalBatch(step=0, sequences=((5, 7), (6, 6), (7, 3)), sources=((0, 2, 7), (1, 0, 6), (2, 0, 3)))
    return source, batch


@pytest.mark.parametrize("cp_size", [1, 2, 3])
def test_microbatch_shards_cover_the_true_tokens_once_with_shifted_labels(cp_size):
    source, batch = _corpus()
    mb = MicroBatch(((5, 7), (6, 6), (7, 3)), Recompute("full", 2))
    seen = {}
    for rank in range(cp_size):
        local = build_microbatch(mb, source=source, batch=batch, group=None, group_size=cp_size, group_rank=rank,
                                 wave_index=0)
        assert local.recompute == Recompute("full", 2)
        params = local.packed_seq_params
        assert params.qkv_format == "thd" and params.local_cp_size == cp_size and params.cp_group is None
        assert params.cu_seqlens_q.tolist() == [0, 7, 13, 16]
        unit = 2 * cp_size
        padded = [-(-n // unit) * unit for n in (7, 6, 3)]
        assert params.cu_seqlens_q_padded.tolist() == [0, padded[0], padded[0] + padded[1], sum(padded)]
        assert local.tokens.shape == (1, sum(padded) // cp_size) == local.position_ids.shape
        for token, label, pos, keep, doc in zip(local.tokens[0].tolist(), local.labels[0].tolist(),
                                                local.position_ids[0].tolist(), local.loss_mask[0].tolist(),
                                                params.shard.doc_ids.tolist()):
            if keep:
                assert (doc, pos) not in seen
                seen[(doc, pos)] = (token, label)
    want = {}
    for doc, (doc_id, offset, length) in enumerate(batch.sources):
        full = source.tokens(doc_id).tolist()
        for pos in range(length):
            want[(doc, pos)] = (full[offset + pos], full[offset + pos + 1])
    assert seen == want


def test_empty_microbatch_and_sequence_parallel_rows_get_masked_filler_documents():
    source, batch = _corpus()
    empty = build_microbatch(MicroBatch(()), source=source, batch=batch, group=None, group_size=2, group_rank=1,
                             wave_index=3)
    assert empty.loss_mask.sum() == 0 and empty.tokens.numel() == 2 and empty.recompute == NO_RECOMPUTE
    padded = build_microbatch(MicroBatch(((7, 3),)), source=source, batch=batch, group=None, group_size=1,
                              group_rank=0, wave_index=0, rows_multiple=8)
    assert padded.tokens.shape[1] % 8 == 0 and int(padded.loss_mask.sum()) == 3


def test_attention_patch_swaps_the_cp_group_only_during_the_call():
    from patches.transformer_attention import _with_microbatch_cp_group

    seen = []

    def original(self, hidden_states, *args, **kwargs):
        seen.append(self.pg_collection.cp)
        return hidden_states

    forward = _with_microbatch_cp_group(original)
    static = types.SimpleNamespace(cp="static", tp="tp")
    module = types.SimpleNamespace(pg_collection=static)
    forward(module, 1, packed_seq_params=types.SimpleNamespace(cp_group="group-of-2"))
    forward(module, 1, packed_seq_params=types.SimpleNamespace(cp_group=None))
    forward(module, 1)
    assert seen == ["group-of-2", "static", "static"]
    assert module.pg_collection is static and static.cp == "static"


def test_attention_patch_applies_and_restores_megatrons_forward():
    from megatron.core.transformer.attention import Attention

    from dcp_megatron.megatron.patch_set import megatron_patch_registry

    from patches import extensions_transformer_engine

    original = vars(Attention)["forward"]
    with megatron_patch_registry() as registry:
        assert Attention.forward is not original and Attention.forward.dcp_original is original
        targets = {p.target for p in registry.patches}
        assert "megatron.core.transformer.attention:Attention.forward" in targets
        te_target = "megatron.core.extensions.transformer_engine:TEDotProductAttention.cp_stream"
        assert (te_target in targets) == extensions_transformer_engine.te_available()
    assert vars(Attention)["forward"] is original


def test_log_line_has_megatron_fields_and_the_plan_summary():
    sequences = [(0, 100), (1, 20), (2, 30), (3, 128)]
    plan = static_cp_plan(sequences, _cost(2), cp_size=2, tokens_per_microbatch=128, recompute=Recompute("full", 1))
    result = StepResult(loss=2.123456789, num_tokens=278, grad_norm=0.5, step_time_s=0.25, num_microbatches=3,
                        busy_s=(0.2, 0.1), plan=plan)
    line = format_log_line(7, 10, result, lr=1e-3, consumed_tokens=1000)
    assert "iteration        7/      10 |" in line and "lm loss: 2.123457E+00 |" in line
    assert "tokens/s: 1112.0" in line and "imbalance: 0.250" in line and "predicted (ms):" in line
    assert "waves 1" in line and "cp sizes cp2x4" in line and "micro-batches/rank 3/3" in line
    assert "recompute full1x3" in line


def test_cost_model_follows_the_run_flags_and_profile(tmp_path):
    import json

    from dcp_megatron.megatron.arguments import parse_args
    from dcp_megatron.megatron.planning import build_cost_model

    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"gemm_flops": 1.5e9}))
    argv = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
            "--swiglu", "--seq-length", "512", "--tokens-per-step", "2048", "--train-iters", "3", "--lr", "1e-3",
            "--mock-data", "--dcp", "--dcp-max-cp-size", "2", "--dcp-memory-budget-gb", "0.5",
            "--dcp-profile", str(profile), "--pipeline-model-parallel-size", "2",
            "--untie-embeddings-and-output-weights"]
    args = parse_args(argv, world_size=8, has_gpu=False)
    cost = build_cost_model(args, padded_vocab_size=512, domain_size=args.data_parallel_size, has_gpu=False)
    assert cost.cluster.name == "cpu" and cost.cluster.domain_size == 4 and cost.cluster.cp_size_limit == 2
    assert cost.cluster.mem_bytes_per_gpu == int(0.5 * 1024 ** 3) and cost.cluster.gemm_flops == 1.5e9
    shape = cost.model
    assert (shape.num_layers, shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim) == (4, 64, 4, 2, 16)
    assert shape.pp == 2 and shape.tp == 1 and shape.gated_mlp and shape.ffn_hidden_size == 256


@pytest.mark.parametrize("flag, kinds", [(None, ("none", "selective", "full")), ("none", ("none",)),
                                         ("full,none", ("none", "full")), ("selective,full", ("selective", "full"))])
def test_dcp_recompute_restricts_the_cost_model(flag, kinds):
    from dcp_megatron.megatron.arguments import parse_args
    from dcp_megatron.megatron.planning import build_cost_model
    from dcp_megatron.planner.policies import make_plan
    from dcp_megatron.planner.validate import validate

    argv = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "512",
            "--tokens-per-step", "2048", "--train-iters", "3", "--lr", "1e-3", "--mock-data", "--dcp"]
    args = parse_args(argv + (["--dcp-recompute", flag] if flag else []), world_size=2, has_gpu=False)
    cost = build_cost_model(args, padded_vocab_size=512, domain_size=args.data_parallel_size, has_gpu=False)
    assert cost.allowed_recompute == kinds
    batch = [(i, n) for i, n in enumerate([512, 300, 100, 7])]
    plan = make_plan(args.dcp_policy, batch, cost, max_seq_len=512)
    validate(plan, batch, cost.cluster, cost)
    assert {mb.recompute.kind for w in plan.waves for g in w.groups for mb in g.microbatches if mb.sequences} <= set(kinds)
