"""In-process tests of the megatron adapter pieces: flags, core attention, data assembly, init slicing."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from dcp_megatron.megatron.arguments import parse_args  # noqa: E402
from dcp_megatron.megatron.core_attention import packed_causal_attention  # noqa: E402
from dcp_megatron.megatron.init_weights import _local_slice  # noqa: E402
from dcp_megatron.megatron.microbatches import assemble_microbatch, static_dp_microbatches  # noqa: E402
from dcp_megatron.megatron.mock_documents import MockDocuments  # noqa: E402

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
        "--tokens-per-step", "1024", "--train-iters", "3", "--lr", "1e-3", "--mock-data"]


def test_good_flags_fill_defaults():
    args = parse_args(BASE + ["--tensor-model-parallel-size", "2"], world_size=4, has_gpu=False)
    assert args.data_parallel_size == 2 and args.ffn_hidden_size == 256 and args.num_query_groups == 4
    assert args.vocab_size == 512 and args.lr_decay_iters == 3


@pytest.mark.parametrize("extra, world_size, has_gpu, words", [
    (["--tensor-model-parallel-size", "3"], 4, False, ["world size 4", "--tensor-model-parallel-size 3"]),
    (["--pipeline-model-parallel-size", "3"], 3, False, ["--num-layers 4", "--pipeline-model-parallel-size 3"]),
    (["--sequence-parallel"], 1, False, ["--sequence-parallel", "--tensor-model-parallel-size > 1"]),
    (["--fp8-format", "hybrid"], 1, False, ["--fp8-format", "no GPU"]),
    (["--pipeline-model-parallel-size", "2"], 2, False, ["--untie-embeddings-and-output-weights", ".cuda()"]),
    (["--data-path", "x"], 1, False, ["--data-path", "--mock-data"]),
    (["--seq-length", "4096"], 1, False, ["--seq-length 4096", "--tokens-per-step 1024"]),
    (["--save-interval", "2"], 1, False, ["--save-interval", "--save"]),
    (["--dcp-policy", "dcp"], 1, False, ["--dcp-policy", "only take effect with --dcp"]),
    (["--dcp", "--recompute-granularity", "full"], 1, False, ["--recompute-granularity", "--dcp"]),
    (["--dcp", "--dcp-recompute", "none,bogus"], 1, False, ["bogus"]),
    (["--context-parallel-size", "2"], 2, False, ["--context-parallel-size"]),
    (["--num-query-groups", "3"], 1, False, ["--num-query-groups 3"]),
    (["--lr-warmup-iters", "5"], 1, False, ["--lr-warmup-iters 5"]),
    (["--recompute-num-layers", "1"], 1, False, ["--recompute-num-layers", "full"]),
    (["--tensorboard-dir", "tb"], 1, False, ["--tensorboard-dir"]),
])
def test_bad_flag_combinations_name_the_flags(extra, world_size, has_gpu, words):
    if extra[0] == "--tensorboard-dir":
        import importlib.util
        if importlib.util.find_spec("tensorboard") is not None:
            pytest.skip("tensorboard is installed: the flag is valid here")
    argv = BASE + extra
    if "--data-path" in extra:
        argv = [a for a in argv if a != "--mock-data"] + ["--mock-data"]
    with pytest.raises(ValueError) as err:
        parse_args(argv, world_size=world_size, has_gpu=has_gpu)
    for word in words:
        assert word in str(err.value)


def _dense_reference(q, k, v, cu_seqlens, scale):
    total = q.shape[0]
    doc = torch.zeros(total, dtype=torch.long)
    for i, (s, e) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
        doc[s:e] = i
    pos = torch.arange(total)
    allowed = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    scores = torch.einsum("thd,shd->hts", q.double(), k.double()) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v.double())


@pytest.mark.parametrize("lengths, heads, kv_heads", [([5, 1, 9], 4, 2), ([16], 2, 2), ([3, 3, 3, 7], 6, 1)])
def test_packed_causal_attention_matches_dense_masked_attention(lengths, heads, kv_heads):
    gen = torch.Generator().manual_seed(sum(lengths))
    total, dim = sum(lengths), 8
    q = torch.randn(total, heads, dim, generator=gen, requires_grad=True)
    k = torch.randn(total, kv_heads, dim, generator=gen, requires_grad=True)
    v = torch.randn(total, kv_heads, dim, generator=gen, requires_grad=True)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    out = packed_causal_attention(q, k, v, cu, softmax_scale=dim ** -0.5)
    ref = _dense_reference(q, k, v, cu, dim ** -0.5)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-5)


def test_mock_documents_are_deterministic_long_tailed_and_capped():
    docs = MockDocuments(seed=3, vocab_size=100, max_positions=256)
    lengths = [docs.num_tokens(d) - 1 for d in range(2000)]
    assert lengths == [MockDocuments(seed=3, vocab_size=100, max_positions=256).num_tokens(d) - 1 for d in range(2000)]
    assert max(lengths) == 256 and min(lengths) >= 1
    assert sorted(lengths)[1000] < 64  # median far below the cap: long-tailed
    assert torch.equal(docs.tokens(17), docs.tokens(17)) and docs.tokens(17).numel() == docs.num_tokens(17)
    assert int(docs.tokens(5).max()) < 100


def test_static_dp_microbatches_cover_every_sequence_once():
    sources = [(d, 0, n) for d, n in enumerate([50, 60, 30, 128, 5, 7, 100])]
    per_rank = [static_dp_microbatches(sources, dp_size=3, dp_rank=r, tokens_per_microbatch=128) for r in range(3)]
    seen = sorted(s for rank in per_rank for mb in rank for s in mb)
    assert seen == sorted(sources)
    for rank in per_rank:
        assert rank and all(sum(s[2] for s in mb) <= 128 for mb in rank)
    # More replicas than micro-batches: the idle replica still gets one (empty) micro-batch.
    assert static_dp_microbatches(sources[:1], dp_size=2, dp_rank=1, tokens_per_microbatch=128) == [[]]


def test_assemble_microbatch_shifts_labels_restarts_positions_and_masks_padding():
    tokens = {0: torch.arange(10, 20), 1: torch.arange(50, 54)}
    mb = assemble_microbatch([(0, 2, 4), (1, 0, 3)], tokens.__getitem__, pad_to_multiple=4)
    assert mb["tokens"][0, :7].tolist() == [12, 13, 14, 15, 50, 51, 52]
    assert mb["labels"][0, :7].tolist() == [13, 14, 15, 16, 51, 52, 53]
    assert mb["position_ids"][0].tolist() == [0, 1, 2, 3, 0, 1, 2, 0]
    assert mb["loss_mask"][0].tolist() == [1, 1, 1, 1, 1, 1, 1, 0]
    assert mb["packed_seq_params"].cu_seqlens_q.tolist() == [0, 4, 7, 8]
    empty = assemble_microbatch([], tokens.__getitem__)
    assert empty["loss_mask"].sum() == 0 and empty["tokens"].numel() == 1
    with pytest.raises(ValueError, match="document 1"):
        assemble_microbatch([(1, 1, 3)], tokens.__getitem__)


def test_tensor_parallel_slices_reassemble_the_master_weight():
    full = torch.arange(8 * 3).reshape(8, 3)
    param = torch.nn.Parameter(torch.empty(4, 3))
    param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 0, 2
    slices = [_local_slice(full, param, 2, r) for r in range(2)]
    # Stride 2 (gated MLP): each rank holds its part of the gate rows and of the up rows.
    assert slices[0][:, 0].tolist() == [0, 3, 12, 15] and slices[1][:, 0].tolist() == [6, 9, 18, 21]
