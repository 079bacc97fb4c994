"""Units of the megatron.training adapter: flags, documents out of samples, the exchange, micro-batch
dicts, the patch set, and that the recompute a micro-batch asks for really runs."""
from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

pytest.importorskip("megatron.core")

from dcp_megatron.config import DcpConfig, DcpUsageError  # noqa: E402
from dcp_megatron.flags.dcp_flags import add_dcp_arguments
from dcp_megatron.training.arguments import validate_dcp_args
from dcp_megatron.core.global_batch import (  # noqa: E402
    DocumentIndex, Documents, documents_needed, exchange_documents, gather_lengths, split_samples)
from dcp_megatron.core.microbatches import MICROBATCH_KEY, build_batch, with_fillers_to_multiple  # noqa: E402
from dcp_megatron.planner.plan import NO_RECOMPUTE, Group, MicroBatch, Recompute, StepPlan, Wave  # noqa: E402
from tests.support.dist_utils import run_distributed  # noqa: E402


def _args(**overrides) -> argparse.Namespace:
    parser = add_dcp_arguments(argparse.ArgumentParser())
    args = parser.parse_args([])
    defaults = dict(context_parallel_size=1, hybrid_context_parallel=False, recompute_granularity=None,
                    pipeline_model_parallel_size=1, tensor_model_parallel_size=1, attention_dropout=0.0,
                    virtual_pipeline_model_parallel_size=None, micro_batch_size=1,
                    dataloader_inter_document_masking=True, data_parallel_size=2, calculate_per_token_loss=True,
                    rank=0, seq_length=1024, log_interval=1)
    vars(args).update(defaults)
    vars(args).update(overrides)
    return args


_MOE = dict(num_experts=4, moe_router_load_balancing_type="aux_loss", expert_model_parallel_size=1)


@pytest.mark.parametrize("overrides, message", [
    (dict(context_parallel_size=2), "--context-parallel-size 2 conflicts with --dcp"),
    (dict(recompute_granularity="full"), "--dcp-recompute"),
    (dict(attention_dropout=0.1), "--attention-dropout"),
    (dict(pipeline_model_parallel_size=4, dataloader_inter_document_masking=False),
     "--pipeline-model-parallel-size 4 needs --dataloader-inter-document-masking"),
    (dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1,
          dataloader_inter_document_masking=False), "and virtual pipeline stages needs --dataloader-inter-document"),
    (dict(_MOE, moe_router_load_balancing_type=["global_aux_loss"]),
     "--moe-router-load-balancing-type global_aux_loss cannot be exact under --dcp"),
    (dict(_MOE, moe_router_load_balancing_type="quantile_balancing"),
     "--moe-router-load-balancing-type quantile_balancing is not supported"),
    (dict(_MOE, expert_model_parallel_size=2, dcp_recompute="selective,full"),
     "--dcp-recompute selective,full: drop 'full' (--expert-model-parallel-size 2"),
    (dict(micro_batch_size=2, dataloader_inter_document_masking=False), "--dataloader-inter-document-masking"),
    (dict(dcp_max_cp_size=4), "exceeds the DCP domain of 2 ranks"),
    (dict(dcp_memory_budget_gb=float("nan")), "--dcp-memory-budget-gb must be a positive number"),
    (dict(dcp_memory_budget_gb=float("inf")), "--dcp-memory-budget-gb must be a positive number"),
    (dict(dcp_recompute="none,sometimes"), "unknown ['sometimes']"),
    (dict(_MOE, expert_model_parallel_size=2, dcp_recompute="none,moe"),
     "--dcp-recompute none,moe: drop 'moe' (--expert-model-parallel-size 2"),
    (dict(dcp_recompute="none,mlp,offload"), "--dcp-recompute offload: megatron-core's fine-grained activation offloading runs on GPU only"),
    (dict(dcp_recompute="none,moe_act", transformer_impl="local"),
     "--dcp-recompute moe_act needs --transformer-impl transformer_engine"),
    (dict(dcp_recompute="layernorm", transformer_impl="local"),
     "--dcp-recompute layernorm needs --transformer-impl transformer_engine"),
    (dict(dcp_profile="/no/such/profile.json"), "no such file"),
    (dict(dcp_cp_attention="allgather,ulysses"), "runs under DeepSpeed (pretrain_scripts/pretrain_gpt_deepspeed.py) only"),
    (dict(dcp_cp_attention="a2a"), "--dcp-cp-attention: unknown ['a2a']"),
    (dict(dcp_check_plans=True, dcp_no_check_plans=True), "contradict each other"),
])
def test_flags_dcp_cannot_honour_are_refused_with_the_flag_named(overrides, message):
    with pytest.raises(DcpUsageError, match=None) as err:
        validate_dcp_args(_args(dcp=True, **overrides))
    assert message in str(err.value)


def test_dcp_flags_without_dcp_are_refused_and_dcp_turns_on_per_token_loss(capsys):
    with pytest.raises(DcpUsageError, match="only take effect with --dcp"):
        validate_dcp_args(_args(dcp=False, dcp_policy="static"))
    args = _args(dcp=True, calculate_per_token_loss=False)
    validate_dcp_args(args)
    assert args.calculate_per_token_loss is True
    assert "--calculate-per-token-loss" in capsys.readouterr().out
    validate_dcp_args(_args(dcp=False))  # plain runs pass untouched
    validate_dcp_args(_args(dcp=True, tensor_model_parallel_size=2, pipeline_model_parallel_size=2))
    validate_dcp_args(_args(dcp=True, pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2))


def test_moe_with_expert_parallelism_takes_full_recompute_out_of_dcps_choices(capsys):
    args = _args(dcp=True, **dict(_MOE, expert_model_parallel_size=2))
    validate_dcp_args(args)
    assert args.dcp_recompute == "none,selective,mlp" and "full and moe recompute would replay MoE" in capsys.readouterr().out
    args = _args(dcp=True, **_MOE)   # EP 1: no all-to-all, every recompute stays allowed
    validate_dcp_args(args)
    assert args.dcp_recompute is None


def test_dcp_config_is_validated():
    with pytest.raises(ValueError):
        DcpConfig(seq_length=0)
    with pytest.raises(ValueError):
        DcpConfig(seq_length=8, policy="best")
    assert DcpConfig(seq_length=8).recompute == ("none", "selective", "full", "mlp")
    from dcp_megatron.flags.dcp_flags import dcp_config_from_args

    # the plan agreement check is on unless turned off
    assert dcp_config_from_args(_args(dcp=True)).check_plans
    assert not dcp_config_from_args(_args(dcp=True, dcp_no_check_plans=True)).check_plans


def _sample(tokens: list[list[int]], bounds: list[list[int]] | None, seq: int) -> dict:
    t = torch.tensor(tokens)
    sample = {"tokens": t, "labels": t + 100, "loss_mask": torch.ones_like(t, dtype=torch.float32)}
    if bounds is not None:
        cu = torch.full((len(tokens), seq + 1), seq, dtype=torch.int32)
        for row, b in enumerate(bounds):
            cu[row, :len(b)] = torch.tensor(b)
        sample["cu_seqlens"] = cu
    return sample


def test_samples_are_cut_into_their_documents_with_masks_kept():
    first = _sample([[1, 2, 3, 4, 5, 6]], [[0, 2, 6]], 6)
    first["loss_mask"][0, 5] = 0  # the dataset's own masking survives
    second = _sample([[7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18]], [[0, 6], [0, 1, 3, 6]], 6)
    docs = split_samples([first, second])
    assert docs.lengths == (2, 4, 6, 1, 2, 3)
    assert docs.rows[:, 0].tolist() == list(range(1, 19))
    assert docs.rows[:, 1].tolist() == list(range(101, 119))
    assert docs.rows[5, 2] == 0 and int(docs.rows[:, 2].sum()) == 17
    whole = split_samples([_sample([[1, 2, 3]], None, 3)])  # no cu_seqlens: a sample is one sequence
    assert whole.lengths == (3,)
    with pytest.raises(ValueError, match="do not cover"):
        split_samples([_sample([[1, 2, 3, 4]], [[0, 3, 2, 4]], 4)])


def _plan_two_ranks() -> StepPlan:
    # Wave 0: rank 0 alone runs docs 0 and 3 in two micro-batches, rank 1 runs doc 1; wave 1: both run doc 2.
    wave0 = Wave((Group(0, 1, (MicroBatch(((0, 3),)), MicroBatch(((3, 2),)))), Group(1, 1, (MicroBatch(((1, 5),)),))))
    wave1 = Wave((Group(0, 2, (MicroBatch(((2, 8),), Recompute("full", 1)),)),))
    return StepPlan(domain_size=2, waves=(wave0, wave1), policy="test")


def test_documents_needed_follow_the_rank_schedule():
    plan = _plan_two_ranks()
    assert documents_needed(plan, 0) == [0, 3, 2]
    assert documents_needed(plan, 1) == [1, 2]


def _exchange_worker(rank: int, world_size: int) -> dict:
    # Rank 0 read docs of lengths (3, 5), rank 1 read (8, 2): ids 0,1 on rank 0 and 2,3 on rank 1.
    local_lengths = [(3, 5), (8, 2)][rank]
    base = 1000 * (rank + 1)
    rows = torch.stack([torch.arange(sum(local_lengths)) + base, torch.arange(sum(local_lengths)),
                        torch.ones(sum(local_lengths), dtype=torch.int64)], dim=1)
    local = Documents(rows=rows, lengths=local_lengths)
    per_rank = gather_lengths(local.lengths, group=None, domain_size=2)
    index = DocumentIndex.build(per_rank)
    received = exchange_documents(_plan_two_ranks(), local, index, domain_rank=rank, group=None)
    # The plan agreement check (on by default): the same plan passes, divergent plans raise on every rank.
    from dcp_megatron.core.planning import check_same_plan

    check_same_plan(_plan_two_ranks(), iteration=1, group=None, device="cpu")
    mine = _plan_two_ranks() if rank == 0 else StepPlan(domain_size=2, waves=_plan_two_ranks().waves[::-1],
                                                       policy="test")
    try:
        check_same_plan(mine, iteration=2, group=None, device="cpu")
        divergent = "not caught"
    except RuntimeError as err:
        divergent = str(err)
    return {"per_rank": per_rank, "received": {k: v[:, 0].tolist() for k, v in received.items()},
            "divergent": divergent}


def test_documents_reach_exactly_the_ranks_that_run_them():
    results = run_distributed(_exchange_worker, 2)
    assert results[0]["per_rank"] == results[1]["per_rank"] == [(3, 5), (8, 2)]
    assert results[0]["received"] == {0: [1000, 1001, 1002], 3: [2008, 2009], 2: list(range(2000, 2008))}
    assert results[1]["received"] == {1: [1003, 1004, 1005, 1006, 1007], 2: list(range(2000, 2008))}
    for result in results:
        assert result["divergent"].startswith("iteration 2: ranks computed different plans"), result["divergent"]


def test_microbatch_dict_follows_the_packed_contract():
    docs = [torch.tensor([[5, 6, 1]] * 3), torch.tensor([[7, 8, 1]] * 5)]
    batch = build_batch(docs, cp_size=2, cp_rank=1, group="G", recompute=Recompute("full", 1), wave_index=3,
                        device="cpu")
    assert batch["cu_seqlens"].tolist() == [[0, 3, 8]]
    assert batch["cu_seqlens_padded"].tolist() == [[0, 4, 12]]  # each document padded to a multiple of 2c
    assert batch["tokens"].shape == (1, 6) and batch["local_cp_size"].tolist() == [2]
    assert batch["max_seqlen"].tolist() == [8]
    # Documents of 3 and 5 tokens padded to 4 and 8: rank 1 holds chunks 1 and 2 of each, 5 real tokens.
    assert float(batch["loss_mask"].sum()) == 5
    other = build_batch(docs, cp_size=2, cp_rank=0, group="G", recompute=NO_RECOMPUTE, wave_index=3, device="cpu")
    assert float(other["loss_mask"].sum()) == 3  # the two ranks together hold every real token once
    context = batch[MICROBATCH_KEY]
    assert (context.group, context.cp_size, context.cp_rank, context.wave_index) == ("G", 2, 1, 3)
    assert context.padding_mask.shape == (1, 6) and int(context.padding_mask.sum()) == 1   # MoE routers skip it
    filler = build_batch([], cp_size=1, cp_rank=0, group=None, recompute=Recompute("full", 1), wave_index=0,
                         device="cpu")
    # a filler runs the relief its plan names: under ZeRO-3 every rank of a wave replays alike (weight gathers pair)
    assert float(filler["loss_mask"].sum()) == 0 and filler[MICROBATCH_KEY].recompute == Recompute("full", 1)


def test_virtual_stages_get_fillers_up_to_the_interleaved_schedules_group_size():
    docs = [torch.tensor([[5, 6, 1]] * 3)]
    batches = [build_batch(docs, cp_size=1, cp_rank=0, group=None, recompute=NO_RECOMPUTE, wave_index=w,
                           device="cpu") for w in range(3)]
    padded = with_fillers_to_multiple(batches, 2, device="cpu")
    assert len(padded) == 4 and padded[:3] == batches
    assert float(padded[3]["loss_mask"].sum()) == 0 and padded[3][MICROBATCH_KEY].wave_index == 3
    assert len(with_fillers_to_multiple(batches, 3, device="cpu")) == 3


def test_patch_set_supports_only_the_versions_it_was_run_on(monkeypatch):
    from patches.megatron_set import megatron_patch_registry
    from patches.registry import PatchVersionError

    registry = megatron_patch_registry(installed_version="0.16.1")
    with pytest.raises(PatchVersionError, match="megatron-core 0.16.1 is not supported"):
        registry.apply()
    assert not registry.applied
    assert all(p.supports("0.19.2") for p in megatron_patch_registry().patches)


def test_no_cpu_shim_is_applied_when_a_gpu_is_reported(monkeypatch):
    from patches import compat
    from patches.megatron_set import megatron_patch_registry

    cpu_targets = {p.target for p in compat.cpu_compat_patches()}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    targets = {p.target for p in megatron_patch_registry().patches}
    assert not targets & cpu_targets
    assert "megatron.training.training:get_forward_backward_func" in targets


def _recompute_worker(rank: int, world_size: int) -> dict:
    """Count each layer's and core attention's forward calls during backward, per recompute setting."""
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams

    from tests.support.megatron_runs import tiny_local_gpt
    from patches.megatron_set import megatron_patch_registry
    from dcp_megatron.core.recompute import apply_recompute

    counts: dict[str, int] = {}
    with megatron_patch_registry():
        parallel_state.initialize_model_parallel()
        model = tiny_local_gpt(num_layers=3, max_sequence_length=32)
        config = model.config
        layers = list(model.decoder.layers)
        phase = {"now": "forward"}

        def hook(name):
            def count(module, args, output):
                key = f"{phase['now']}:{name}"
                counts[key] = counts.get(key, 0) + 1
            return count

        for i, layer in enumerate(layers):
            layer.register_forward_hook(hook(f"layer{i}"))
            layer.self_attention.core_attention.register_forward_hook(hook(f"attn{i}"))
            layer.mlp.register_forward_hook(hook(f"mlp{i}"))
        tokens = torch.randint(0, 64, (1, 12))
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 5, 12], dtype=torch.int32),
                                 cu_seqlens_kv=torch.tensor([0, 5, 12], dtype=torch.int32),
                                 max_seqlen_q=7, max_seqlen_kv=7)
        results = {}
        for recompute in (NO_RECOMPUTE, Recompute("full", 2), Recompute("selective"), Recompute.of_modules({"mlp"}),
                          Recompute.of_modules({"core_attn", "mlp"})):
            counts.clear()
            apply_recompute(model, recompute)
            phase["now"] = "forward"
            loss = model(tokens, torch.arange(12).unsqueeze(0), None, labels=tokens, packed_seq_params=params).sum()
            phase["now"] = "backward"
            loss.backward()
            results[str(recompute)] = dict(counts)
        # Pipeline order: micro-batch A (full 2) runs forward, then B (selective), then A's backward replays A.
        # The replay must recompute A as A asked (core attention once more), not as the latest micro-batch B did.
        from dcp_megatron.training import forward_step
        from dcp_megatron.core.microbatch_facts import MicroBatchFacts

        def forward(recompute):
            facts = MicroBatchFacts(wave_index=0, cp_size=1, cp_rank=0, group=None, recompute=recompute)
            hook = forward_step.facts_on_model_calls(model, facts)   # what DcpForwardStep does per micro-batch
            try:
                apply_recompute(model, recompute)
                own = PackedSeqParams(**{name: getattr(params, name) for name in (
                    "qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "max_seqlen_q", "max_seqlen_kv")})
                return model(tokens, torch.arange(12).unsqueeze(0), None, labels=tokens, packed_seq_params=own).sum()
            finally:
                hook.remove()

        import json
        import tempfile

        from dcp_megatron.core.microbatch_trace import MicrobatchTrace

        # The trace --dcp-dump-plans writes records what each micro-batch's backward replayed, not the switches.
        directory = tempfile.mkdtemp()
        trace = MicrobatchTrace(directory, rank=0)
        trace.attach([model], config, iteration=7)
        loss_a = forward(Recompute("full", 2))
        loss_b = forward(Recompute("selective"))
        loss_c = forward(NO_RECOMPUTE)
        loss_d = forward(Recompute.of_modules({"mlp"}))   # the latest: its MLP switch is on when A replays
        counts.clear()
        phase["now"] = "backward"
        loss_a.backward()
        results["full2 after selective"] = dict(counts)
        loss_c.backward()
        loss_b.backward()
        loss_d.backward()
        trace.detach()
        with open(trace.path) as f:
            results["trace"] = [json.loads(line) for line in f]
        # Switches that ask for a replay the module does not run: megatron-core checkpoints full layers and core
        # attention only in training mode, so a forward in eval mode with grads keeps every activation and its
        # backward replays nothing. The trace must say what ran ("none"), not what the switches asked.
        trace = MicrobatchTrace(directory, rank=0)
        trace.attach([model], config, iteration=8)
        model.eval()
        try:
            unreplayed = [forward(Recompute("full", 2)), forward(Recompute("selective"))]
        finally:
            model.train()
        for loss in reversed(unreplayed):
            loss.backward()
        trace.detach()
        with open(trace.path) as f:
            results["trace_unreplayed"] = [r for r in map(json.loads, f) if r["iteration"] == 8]
        # activation offload (GPU only to run): DCP's switch on megatron-core's real layers, built as DCP builds
        # them (--offload-modules core_attn attn_proj), is each micro-batch's set, then off
        from dcp_megatron.core.offload import apply_offload

        built = tiny_local_gpt(num_layers=2, max_sequence_length=32, fine_grained_activation_offloading=True,
                               offload_modules=["core_attn", "attn_proj"])

        def read_at_forward():   # what Attention.forward reads (megatron-core 0.19.2)
            return [(a.offload_core_attention, a.offload_attn_proj) for a in
                    (layer.self_attention for layer in built.decoder.layers)]

        results["offload"] = [read_at_forward()]
        for offload in ({"core_attn"}, set(), {"core_attn", "attn_proj"}):
            apply_offload(built, frozenset(offload))
            results["offload"].append(read_at_forward())
        results["biased"] = _biased_mlp_recompute(tokens, params)
        results["at_forward"] = _recompute_at_each_forward(model, config)
        # virtual pipeline stages: megatron.training builds each chunk from its own config; full recompute is set
        # on every chunk's (k of the stage's 2 layers: ceil(k / 2) of each chunk's one), and put back
        from dcp_megatron.core.recompute import restore_recompute, snapshot_recompute

        chunks = [tiny_local_gpt(num_layers=1, max_sequence_length=32) for _ in range(2)]
        assert chunks[0].config is not chunks[1].config
        saved = snapshot_recompute(chunks)
        results["chunks"] = []
        for recompute in (Recompute("full", 2), Recompute("full", 1), Recompute.of_modules({"mlp"})):
            for chunk in chunks:
                apply_recompute(chunk, recompute, stage_layers=2)
            results["chunks"].append([(c.config.recompute_granularity, c.config.recompute_num_layers,
                                       c.decoder.layers[0].recompute_mlp) for c in chunks])
        apply_recompute(chunks[1], Recompute("full", 2), stage_layers=2)
        restore_recompute(chunks, saved)
        results["chunks"].append([(c.config.recompute_granularity, c.config.recompute_num_layers,
                                   c.decoder.layers[0].recompute_mlp) for c in chunks])
        parallel_state.destroy_model_parallel()
    return results


# A step whose micro-batches each ask for another recompute: full layers, module sets (layernorm's switch is not pinned
# per call as core_attn's and mlp's are) and none, in an order where each differs from the one before.
_ASKED = (Recompute("full", 2), NO_RECOMPUTE, Recompute.of_modules({"mlp"}), Recompute("full", 1),
          Recompute.of_modules({"core_attn", "layernorm"}), Recompute("full", 3), Recompute.of_modules({"core_attn"}))


def _recompute_at_each_forward(model, config) -> list:
    """What the model holds when the user's forward step runs each micro-batch under DcpForwardStep: the block
    recompute of the config and the module switches of every layer (the switches each forward reads)."""
    from dcp_megatron.core.microbatch_facts import MICROBATCH_KEY, MicroBatchFacts
    from dcp_megatron.core.recompute import modules_on
    from dcp_megatron.training.forward_step import DcpForwardStep

    layers = list(model.decoder.layers)
    seen = []

    def user_forward_step(data_iterator, model):
        next(data_iterator)
        seen.append((config.recompute_granularity, config.recompute_num_layers, sorted(modules_on(layers))))
        return None, None

    batches = [{MICROBATCH_KEY: MicroBatchFacts(wave_index=i, cp_size=1, cp_rank=0, group=None, recompute=asked)}
               for i, asked in enumerate(_ASKED)]
    step = DcpForwardStep(user_forward_step, batches, model_chunks=[model], config=config)
    for _ in batches:
        step(None, model)
    return seen


def _biased_mlp_recompute(tokens, params) -> dict:
    """A GPT-2-style model (GELU MLP, linear biases: megatron's defaults) under MLP recompute, two micro-batches
    per step as a plan runs them: megatron-core's MLP returns its bias Parameter through the checkpoint, which
    must leave the Parameter a leaf (patches/tensor_parallel_random.py; without it backward recursed until the
    rank died). Gradients against the same steps without recompute."""
    import torch.nn.functional as F

    from tests.support.megatron_runs import tiny_local_gpt
    from dcp_megatron.core.recompute import apply_recompute

    model = tiny_local_gpt(num_layers=2, max_sequence_length=32, add_bias_linear=True, gated_linear_unit=False,
                           activation_func=F.gelu)
    position_ids = torch.arange(12).unsqueeze(0)
    out = {}
    for recompute in (NO_RECOMPUTE, Recompute.of_modules({"mlp"}), Recompute.of_modules({"core_attn", "mlp"})):
        model.zero_grad(set_to_none=True)
        apply_recompute(model, recompute)
        losses = [model(tokens, position_ids, None, labels=tokens, packed_seq_params=params).sum() for _ in range(2)]
        biases_are_leaves = all(layer.mlp.linear_fc2.bias.is_leaf for layer in model.decoder.layers)
        if biases_are_leaves:   # otherwise backward would recurse: the assertion reports it instead
            for loss in reversed(losses):
                loss.backward()
        out[str(recompute)] = {"leaves": biases_are_leaves,
                               "grads": {name: None if p.grad is None else p.grad.tolist()
                                         for name, p in model.named_parameters()}}
    apply_recompute(model, NO_RECOMPUTE)
    return out


def _one_rank_cases_worker(rank: int, world_size: int) -> dict:
    """The file's one-rank cases in one launch, one after the other (each sets up and tears down its own state)."""
    return {"recompute": _recompute_worker(rank, world_size), "middle_stage": _middle_stage_worker(rank, world_size)}


@pytest.fixture(scope="module")
def one_rank_results() -> dict:
    """case -> its result (a launch's start-up is most of its cost: one for both cases)."""
    return run_distributed(_one_rank_cases_worker, 1)[0]


def test_the_recompute_a_microbatch_asks_for_really_runs_in_backward(one_rank_results):
    results = one_rank_results["recompute"]
    none, full, selective = results["none"], results["full2"], results["selective"]
    assert not any(k.startswith("backward:") for k in none)
    # full k=2: the first two layers run their forward again in backward, the third does not.
    assert full.get("backward:layer0") == 1 and full.get("backward:layer1") == 1
    assert "backward:layer2" not in full
    # selective: every layer's core attention (and nothing else) is recomputed.
    assert all(selective.get(f"backward:attn{i}") == 1 for i in range(3))
    assert not any(k.startswith("backward:layer") for k in selective)
    assert not any(k.startswith("backward:mlp") for k in selective)
    # module recompute (megatron-core's recompute_modules, switched per micro-batch): exactly the modules named
    mlp, both = results["mlp"], results["core_attn+mlp"]
    assert {k for k in mlp if k.startswith("backward:")} == {f"backward:mlp{i}" for i in range(3)}, mlp
    assert {k for k in both if k.startswith("backward:")} == {f"backward:{m}{i}" for i in range(3)
                                                               for m in ("mlp", "attn")}, both
    # a full-recompute replay keeps its own micro-batch's choice (patches/transformer_attention.py): a CP group's
    # ranks replaying with different choices would issue different collectives and hang
    replay = results["full2 after selective"]
    assert replay.get("backward:layer0") == 1 and replay.get("backward:attn0") == 1, replay
    assert replay.get("backward:mlp0") == 1, replay   # the MLP too (patches/transformer_transformer_layer.py)
    # the trace names what each micro-batch's backward replayed (backwards out of forward order, as in 1F1B)
    trace = results["trace"]
    assert [(r["iteration"], r["recompute"], r["recompute_set"]) for r in trace] == [
        (7, "full2", "full2"), (7, "selective", "selective"), (7, "none", "none"), (7, "mlp", "mlp")], trace
    assert trace[0]["replayed"] == {"layer": 2, "core_attention": 2, "mlp": 2}, trace
    assert trace[3]["replayed"] == {"layer": 0, "core_attention": 0, "mlp": 3}, trace
    assert trace[1]["replayed"] == {"layer": 0, "core_attention": 3, "mlp": 0}, trace
    # switches on, no replay (eval mode): the trace is what the backward ran, not what the switches or plan asked
    unreplayed = results["trace_unreplayed"]
    assert [(r["recompute"], r["recompute_set"]) for r in unreplayed] == [("none", "full2"), ("none", "selective")], \
        unreplayed
    assert all(set(r["replayed"].values()) == {0} for r in unreplayed), unreplayed
    on, attention_only, off = [(True, True)] * 2, [(True, False)] * 2, [(False, False)] * 2
    assert results["offload"] == [on, attention_only, off, on], results["offload"]
    assert results["chunks"] == [[("full", 1, False)] * 2, [("full", 1, False)] * 2, [(None, None, True)] * 2,
                                 [(None, None, False)] * 2], results["chunks"]
    # each micro-batch's forward runs under its own recompute (not the previous micro-batch's)
    expected = [("full", r.full_layers, []) if r.kind == "full" else (None, None, sorted(r.modules))
                for r in _ASKED]
    assert [tuple(seen) for seen in results["at_forward"]] == expected, results["at_forward"]
    # MLP recompute of a model with linear biases: the bias stays a Parameter, backward ends, gradients exact
    biased = results["biased"]
    reference = biased["none"]["grads"]
    assert any(name.endswith("linear_fc2.bias") for name in reference) and all(g is not None for g in reference.values())
    for name in ("mlp", "core_attn+mlp"):
        assert biased[name]["leaves"], f"{name} recompute made the MLP's bias Parameter a checkpoint output"
        for param, grad in biased[name]["grads"].items():
            assert torch.allclose(torch.tensor(grad), torch.tensor(reference[param]), rtol=1e-5, atol=1e-7), \
                (name, param)


def test_run_paths_are_checked_at_start_up(tmp_path):
    from dcp_megatron.training.checks.run_paths import TRACKER_FILE, check_run_paths

    def paths(**given):
        return argparse.Namespace(**{"save": None, "load": None, "tensorboard_dir": None, "dcp_dump_plans": None,
                                     **given})

    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for flag, attr in (("--save", "save"), ("--tensorboard-dir", "tensorboard_dir"),
                       ("--dcp-dump-plans", "dcp_dump_plans")):
        with pytest.raises(DcpUsageError, match=f"{flag} .*exists and is not a directory"):
            check_run_paths(paths(**{attr: str(a_file)}))
        with pytest.raises(DcpUsageError, match="is a file, so the directory cannot be created"):
            check_run_paths(paths(**{attr: str(a_file / "sub")}))
    check_run_paths(paths(save=str(tmp_path / "new" / "ckpt"), tensorboard_dir=str(tmp_path / "tb")))
    with pytest.raises(DcpUsageError, match="--load .*no such directory.*drop --load"):
        check_run_paths(paths(load=str(tmp_path / "missing"), save=str(tmp_path / "ckpt")))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DcpUsageError, match="holds no Megatron checkpoint"):
        check_run_paths(paths(load=str(empty)))
    # --load = --save is Megatron's auto-resume: the first run has nothing to load yet
    check_run_paths(paths(load=str(tmp_path / "auto"), save=str(tmp_path / "auto")))
    (empty / TRACKER_FILE).write_text("5")
    with pytest.raises(DcpUsageError, match="tracker .* names iter_0000005, which does not exist"):
        check_run_paths(paths(load=str(empty)))   # Megatron would fail only after building the model
    (empty / "iter_0000005").mkdir()
    check_run_paths(paths(load=str(empty)))



def _middle_stage_worker(rank: int, world_size: int) -> dict:
    """What a model receives when the script's PackedSeqParams lacks the micro-batch's CP size and group (Megatron-LM's
    get_batch on a middle pipeline stage), inside a DCP micro-batch's forward step and outside one."""
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams

    from dcp_megatron.training import forward_step
    from dcp_megatron.core.microbatch_facts import MicroBatchFacts
    from patches.megatron_set import megatron_patch_registry
    from tests.support.megatron_runs import tiny_local_gpt

    class Seen(Exception):
        pass

    class Group:   # stands for the micro-batch's CP group: the model must receive this very object
        def size(self):
            return 2

    group = Group()
    received = {}
    with megatron_patch_registry():
        parallel_state.initialize_model_parallel()
        model = tiny_local_gpt(num_layers=1, max_sequence_length=32)

        def stop(module, args, kwargs):
            params = kwargs.get("packed_seq_params")
            received["now"] = (params.local_cp_size, params.cp_group is group)
            raise Seen

        model.decoder.register_forward_pre_hook(stop, with_kwargs=True)
        bounds = torch.tensor([0, 12], dtype=torch.int32)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, max_seqlen_q=12,
                                 max_seqlen_kv=12)
        tokens = torch.randint(0, 64, (1, 6))
        results = {}
        for name, facts in (("outside", None), ("dcp_cp2", MicroBatchFacts(
                wave_index=0, cp_size=2, cp_rank=0, group=group, recompute=NO_RECOMPUTE))):
            # what DcpForwardStep does for the duration of a micro-batch's forward step
            hook = None if facts is None else forward_step.facts_on_model_calls(model, facts)
            try:
                model(tokens, torch.arange(6).unsqueeze(0), None, packed_seq_params=dataclasses.replace(params))
            except Seen:
                results[name] = received.pop("now")
            finally:
                if hook is not None:
                    hook.remove()
        parallel_state.destroy_model_parallel()
    return results


def test_a_middle_pipeline_stage_gets_the_microbatchs_cp_size_and_group(one_rank_results):
    """patches/models_gpt_gpt_model.py: Megatron-LM's get_batch gives middle stages params without them."""
    results = one_rank_results["middle_stage"]
    assert results == {"outside": (None, False), "dcp_cp2": (2, True)}, results
