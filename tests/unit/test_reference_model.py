"""TinyGPT: packing documents changes nothing, recompute switches change nothing but are honoured."""
import dataclasses
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from dcp_megatron.planner.costmodel import model_preset
from dcp_megatron.runtime.cp_attention import cp_attention, packed_causal_attention
from dcp_megatron.runtime.sharding import shard_microbatch
from tests.support.dist_utils import max_rel_err
from tests.support.reference.tiny_gpt import TinyGPT, TinyGPTConfig

CONFIG = TinyGPTConfig(vocab_size=97, num_layers=3, hidden_size=32, num_heads=4, num_kv_heads=2, ffn_hidden_size=48)
LENGTHS = [5, 17, 1, 9]


def _documents(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CONFIG.vocab_size, (n + 1,), generator=gen) for n in LENGTHS]  # +1: next-token targets


def _packed_loss(model: TinyGPT, docs: list[torch.Tensor], attention=None) -> torch.Tensor:
    """Sum of per-token losses of all documents packed into one micro-batch."""
    tokens = torch.cat([d[:-1] for d in docs])
    targets = torch.cat([d[1:] for d in docs])
    positions = torch.cat([torch.arange(len(d) - 1) for d in docs])
    cu_seqlens = torch.tensor([0] + [len(d) - 1 for d in docs]).cumsum(0)
    attention = attention or partial(packed_causal_attention, cu_seqlens=cu_seqlens)
    return F.cross_entropy(model(tokens, positions, attention), targets, reduction="sum")


def _grads(model: TinyGPT, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    return dict(zip([n for n, _ in model.named_parameters()], torch.autograd.grad(loss, list(model.parameters()))))


def test_packed_documents_equal_separate_documents():
    model = TinyGPT(CONFIG, seed=1)
    docs = _documents()
    packed = _packed_loss(model, docs)
    packed_grads = _grads(model, packed)
    separate = sum(_packed_loss(model, [d]) for d in docs)
    separate_grads = _grads(model, separate)
    assert abs(packed.item() - separate.item()) <= 1e-6 * abs(separate.item())
    for name, grad in packed_grads.items():
        assert max_rel_err(grad, separate_grads[name]) < 1e-5, name


def test_positions_restart_in_every_document():
    # The same document alone and after another one must give the same logits.
    model = TinyGPT(CONFIG, seed=2)
    doc = _documents()[1][:-1]
    other = _documents(seed=5)[0][:-1]
    alone = model(doc, torch.arange(len(doc)), partial(packed_causal_attention, cu_seqlens=torch.tensor([0, len(doc)])))
    tokens = torch.cat([other, doc])
    positions = torch.cat([torch.arange(len(other)), torch.arange(len(doc))])
    cu = torch.tensor([0, len(other), len(tokens)])
    packed = model(tokens, positions, partial(packed_causal_attention, cu_seqlens=cu))
    assert max_rel_err(packed[len(other):], alone) < 1e-5


@pytest.mark.parametrize("switches", ["core_attention", "layers", "mixed"])
def test_recompute_switches_keep_results_and_recompute(switches):
    model = TinyGPT(CONFIG, seed=3)
    docs = _documents()
    baseline = _packed_loss(model, docs)
    baseline_grads = _grads(model, baseline)

    calls = []
    cu_seqlens = torch.tensor([0] + LENGTHS).cumsum(0)

    def counting_attention(q, k, v):
        calls.append(1)
        return packed_causal_attention(q, k, v, cu_seqlens)

    for i, block in enumerate(model.layers):
        block.attn.checkpoint_core_attention = switches == "core_attention" or (switches == "mixed" and i == 0)
        block.checkpoint_layer = switches == "layers" or (switches == "mixed" and i == 2)
    loss = _packed_loss(model, docs, counting_attention)
    grads = _grads(model, loss)
    recomputed_layers = 3 if switches != "mixed" else 2
    assert len(calls) == CONFIG.num_layers + recomputed_layers  # the switches really re-ran attention in backward
    assert abs(loss.item() - baseline.item()) <= 1e-7 * abs(baseline.item())
    for name, grad in grads.items():
        assert max_rel_err(grad, baseline_grads[name]) < 1e-6, name

    for block in model.layers:  # switched off again, the next forward keeps activations
        block.checkpoint_layer = block.attn.checkpoint_core_attention = False
    calls.clear()
    _grads(model, _packed_loss(model, docs, counting_attention))
    assert len(calls) == CONFIG.num_layers


def test_sharded_forward_with_cp_attention_matches_packed():
    model = TinyGPT(CONFIG, seed=4)
    docs = _documents()
    tokens = torch.cat([d[:-1] for d in docs])
    cu_seqlens = torch.tensor([0] + LENGTHS).cumsum(0)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    expected = model(tokens, positions, partial(packed_causal_attention, cu_seqlens=cu_seqlens))
    shard = shard_microbatch(LENGTHS, 1, 0)  # odd lengths: padding rows inside the local layout
    logits = model(shard.take(tokens), shard.position_ids, partial(cp_attention, shard=shard, group=None))
    assert max_rel_err(logits[shard.valid_mask], shard.take(expected)[shard.valid_mask]) < 1e-5


def test_init_is_deterministic_per_seed():
    a, b, c = TinyGPT(CONFIG, seed=7), TinyGPT(CONFIG, seed=7), TinyGPT(CONFIG, seed=8)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name


@pytest.mark.parametrize("change, message", [
    (dict(num_heads=5), "multiple of num_heads"),
    (dict(num_kv_heads=3), "multiple of num_kv_heads"),
    (dict(hidden_size=24, num_heads=8, num_kv_heads=2), "even for RoPE"),
    (dict(num_layers=0), "num_layers"),
])
def test_config_rejects_bad_shapes(change, message):
    fields = dict(vocab_size=10, num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2, ffn_hidden_size=8)
    with pytest.raises(ValueError, match=message):
        TinyGPTConfig(**{**fields, **change})


def test_config_from_a_planner_shape_builds_the_model_the_cost_model_counts():
    shape = model_preset("gpt-tiny")
    model = TinyGPT(TinyGPTConfig.from_shape(shape))
    assert sum(p.numel() for p in model.parameters()) == shape.num_params
    with pytest.raises(ValueError, match="num_heads x head_dim"):
        TinyGPTConfig.from_shape(dataclasses.replace(shape, head_dim=shape.head_dim * 2))
    with pytest.raises(ValueError, match="gated_mlp=False"):
        TinyGPTConfig.from_shape(dataclasses.replace(shape, gated_mlp=False))
