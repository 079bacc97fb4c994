"""In-process tests of the megatron adapter pieces: flags, core attention, init slicing.

The DCP pieces (plans from flags, domains, per-rank micro-batches) are in test_megatron_dcp_units.py."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from dcp_megatron.megatron.arguments import parse_args  # noqa: E402
from dcp_megatron.megatron.core_attention import packed_causal_attention  # noqa: E402
from dcp_megatron.megatron.init_weights import _local_slice  # noqa: E402

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
        "--tokens-per-step", "1024", "--train-iters", "3", "--lr", "1e-3", "--mock-data"]


def test_good_flags_fill_defaults():
    args = parse_args(BASE + ["--tensor-model-parallel-size", "2"], world_size=4, has_gpu=False)
    assert args.data_parallel_size == 2 and args.ffn_hidden_size == 256 and args.num_query_groups == 4
    assert args.vocab_size == 512 and args.lr_decay_iters == 3
    # The DCP domain is DP x CP: Megatron runs CP 1 and the runtime re-partitions the domain.
    args = parse_args(BASE + ["--context-parallel-size", "2"], world_size=4, has_gpu=False)
    assert args.data_parallel_size == 4 and not args.dcp
    args = parse_args(BASE + ["--dcp"], world_size=2, has_gpu=False)
    assert args.dcp_policy == "dcp"


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
    (["--dcp", "--dcp-recompute", ","], 1, False, ["--dcp-recompute", "empty list"]),
    (["--context-parallel-size", "2", "--dcp"], 2, False, ["--context-parallel-size 2", "--dcp-max-cp-size"]),
    (["--context-parallel-size", "2", "--attention-dropout", "0.1"], 2, False, ["--attention-dropout"]),
    (["--dcp", "--dcp-max-cp-size", "4"], 2, False, ["--dcp-max-cp-size 4", "2 ranks"]),
    (["--dcp", "--dcp-profile", "/nonexistent.json"], 2, False, ["--dcp-profile", "no such file"]),
    (["--num-query-groups", "3"], 1, False, ["--num-query-groups 3"]),
    (["--lr-warmup-iters", "5"], 1, False, ["--lr-warmup-iters 5"]),
    (["--recompute-num-layers", "1"], 1, False, ["--recompute-num-layers", "full"]),
    (["--tensorboard-dir", "tb"], 1, False, ["--tensorboard-dir"]),
    (["--bf16"], 1, False, ["--bf16", "GPU"]),
    (["--attention-backend", "te"], 1, False, ["--attention-backend te", "Transformer Engine"]),
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


def test_tensor_parallel_slices_reassemble_the_master_weight():
    full = torch.arange(8 * 3).reshape(8, 3)
    param = torch.nn.Parameter(torch.empty(4, 3))
    param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 0, 2
    slices = [_local_slice(full, param, 2, r) for r in range(2)]
    # Stride 2 (gated MLP): each rank holds its part of the gate rows and of the up rows.
    assert slices[0][:, 0].tolist() == [0, 3, 12, 15] and slices[1][:, 0].tolist() == [6, 9, 18, 21]
