"""CP attention (all-gather, ring and Ulysses) vs the single-process packed reference, forward and backward.

One 4-rank gloo launch runs every distributed case: groups of size 1, 2 (two pairs at once), 3 and 4,
both implementations, GQA and MHA, documents shorter than 2c, ranks holding only padding, and
documents long enough to be cut into several query and key tiles.
"""
import math
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from dcp_megatron.runtime import attention_blocks
from dcp_megatron.runtime.cp_attention import cp_attention, packed_causal_attention
from dcp_megatron.runtime.sharding import shard_microbatch
from tests.support.dist_utils import max_rel_err, run_distributed

FP32_TOL = 3e-6  # measured worst 1.5e-6: fp32 rounding of the reference and of the tiled sums
FP64_TOL = 1e-12
# (heads, kv heads, query/key head dim, value head dim): value dims below and above the query's (multi-latent
# attention's up-projected values are narrower than its queries with their rotary part)
HEAD_SHAPES = ((4, 4, 8, 8), (4, 2, 8, 6), (6, 1, 4, 4), (4, 4, 6, 10))


def _lengths(kind: str, cp_size: int, gen: torch.Generator) -> list[int]:
    def randint(lo, hi, n):
        return torch.randint(lo, hi + 1, (n,), generator=gen).tolist()
    if kind == "tiny":  # every document shorter than 2c: some ranks hold nothing but padding
        return randint(1, max(1, 2 * cp_size - 1), 3)
    if kind == "mixed":
        return randint(1, 2 * cp_size, 3) + randint(5, 90, 5)
    # "long": local rows beyond one query tile and natural keys beyond one key tile
    return [2 * cp_size + 1] + randint(2100, 2600, 1) + randint(1, 40, 2)


def _cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lengths).cumsum(0)


def _check_case(lengths, cp_size, cp_rank, group, impl, heads, kv_heads, head_dim, value_dim, dtype, seed) -> float:
    """Runs one case on this rank; returns the worst relative error seen (asserts it is within tolerance)."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, heads, head_dim, generator=gen, dtype=dtype, requires_grad=True)
    k = torch.randn(total, kv_heads, head_dim, generator=gen, dtype=dtype, requires_grad=True)
    v = torch.randn(total, kv_heads, value_dim, generator=gen, dtype=dtype, requires_grad=True)
    weight = torch.randn(total, heads, value_dim, generator=gen, dtype=dtype)
    ref = packed_causal_attention(q, k, v, _cu_seqlens(lengths))
    ref_grads = torch.autograd.grad((ref * weight).sum(), (q, k, v))

    shard = shard_microbatch(lengths, cp_size, cp_rank)
    valid = shard.valid_mask[:, None, None]
    # Padding rows get noise, not zeros: it must not leak into any valid output or gradient.
    noise_gen = torch.Generator().manual_seed(seed * 7 + cp_rank)

    def local(x):
        noise = torch.randn(shard.num_local_tokens, *x.shape[1:], generator=noise_gen, dtype=dtype)
        return torch.where(valid, shard.take(x.detach()), noise).requires_grad_()

    q_local, k_local, v_local = local(q), local(k), local(v)
    out = cp_attention(q_local, k_local, v_local, shard, group, impl=impl)
    grads = torch.autograd.grad((out * shard.take(weight)).sum(), (q_local, k_local, v_local))

    worst = 0.0
    tol = FP32_TOL if dtype == torch.float32 else FP64_TOL
    label = f"{impl} c={cp_size} rank={cp_rank} heads={heads}/{kv_heads} dims={head_dim}/{value_dim} {dtype} " \
            f"lengths={lengths}"
    for name, actual, expected in [("out", out, ref)] + list(zip(("dq", "dk", "dv"), grads, ref_grads)):
        expected_local = shard.take(expected)
        err = max_rel_err(actual[shard.valid_mask], expected_local[shard.valid_mask])
        assert err <= tol, f"{name} rel err {err:.3g} > {tol} for {label}"
        assert torch.all(actual[~shard.valid_mask] == 0), f"{name} non-zero at padding rows for {label}"
        worst = max(worst, err)
    return worst


def _all_cases(rank: int, world_size: int) -> dict:
    assert world_size == 4
    singles = [dist.new_group([r]) for r in range(4)]  # every rank creates every group, same order
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    triple = dist.new_group([0, 1, 2])
    everyone = dist.group.WORLD
    worst: dict[str, float] = {}
    case = 0
    for impl in ("allgather", "ring", "ulysses"):
        for cp_size in (1, 2, 3, 4):
            for kind in ("tiny", "mixed", "long"):
                for dtype in (torch.float32, torch.float64):
                    case += 1
                    if (kind == "long" or impl == "ulysses") and dtype == torch.float64:
                        continue  # fp64 adds nothing the short cases don't show, at 2x the cost
                    if impl == "ulysses" and kind == "long":
                        continue  # Ulysses runs whole documents through SDPA: no tiles to cross
                    heads, kv_heads, head_dim, value_dim = HEAD_SHAPES[case % len(HEAD_SHAPES)]
                    if impl == "ulysses" and heads % cp_size:  # Ulysses splits the query heads over the group
                        heads, kv_heads = 12, (2 if case % 2 else 12)   # kv heads replicated (c = 3, 4) or split
                    if cp_size == 1:
                        group, cp_rank, member = (None if case % 2 else singles[rank]), 0, rank
                    elif cp_size == 2:
                        group, cp_rank, member = pairs[rank // 2], rank % 2, rank // 2
                    elif cp_size == 3:
                        if rank == 3:
                            continue
                        group, cp_rank, member = triple, rank, 0
                    else:
                        group, cp_rank, member = everyone, rank, 0
                    seed = 1000 * case + member  # members of one group share data; concurrent groups differ
                    lengths = _lengths(kind, cp_size, torch.Generator().manual_seed(seed))
                    # "mixed" runs with tiny tiles: many tile borders inside and between documents.
                    small = kind == "mixed"
                    with mock.patch.multiple(attention_blocks, QUERY_TILE_ROWS=4 if small else 512,
                                             KEY_TILE_ROWS=8 if small else 2048):
                        err = _check_case(lengths, cp_size, cp_rank, group, impl, heads, kv_heads, head_dim, value_dim,
                                          dtype, seed)
                    dims = "" if value_dim == head_dim else " dv!=d"
                    for key in (f"{impl} c={cp_size} {str(dtype)[6:]}", f"{impl}{dims}"):
                        worst[key] = max(worst.get(key, 0.0), err)
    # A shard built for another rank or group size is a user mistake, caught before communicating.
    wrong = shard_microbatch([5, 9], 4, (rank + 1) % 4)
    t = wrong.num_local_tokens
    with pytest.raises(ValueError, match="cp_rank"):
        cp_attention(torch.zeros(t, 2, 4), torch.zeros(t, 2, 4), torch.zeros(t, 2, 4), wrong, everyone)
    return worst


# make test-slow (4 ranks on 2 cores, ~50 s): make test trains through the same attention on 2 and 3 ranks
# (test_runtime_parity.py world 3, the Megatron and DeepSpeed launches, Ulysses under ZeRO-3)
@pytest.mark.slow
def test_cp_attention_matches_reference_on_4_ranks():
    results = run_distributed(_all_cases, 4, timeout_s=600)
    merged: dict[str, float] = {}
    for per_rank in results:
        for key, err in per_rank.items():
            merged[key] = max(merged.get(key, 0.0), err)
    print("\nworst relative error per variant:", {k: f"{v:.2e}" for k, v in sorted(merged.items())})
    assert {f"{impl} c={c} float32" for impl in ("allgather", "ring", "ulysses") for c in (1, 2, 3, 4)} <= set(merged)
    assert {f"{impl} dv!=d" for impl in ("allgather", "ring", "ulysses")} <= set(merged)


# ---- single-process checks ----------------------------------------------------------------------------

def _dense_reference(q, k, v, lengths):
    """Independent reference: one T x T mask over the whole packed batch."""
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(sum(lengths)) - (_cu_seqlens(lengths)[:-1])[doc]
    allowed = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    kk = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    vv = v.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) / math.sqrt(q.shape[-1])
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, vv)


def test_packed_reference_equals_dense_masked_attention():
    gen = torch.Generator().manual_seed(3)
    lengths = [1, 7, 30, 2, 64]
    q = torch.randn(sum(lengths), 4, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(sum(lengths), 2, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(sum(lengths), 2, 8, generator=gen, dtype=torch.float64)
    out = packed_causal_attention(q, k, v, _cu_seqlens(lengths))
    assert max_rel_err(out, _dense_reference(q, k, v, lengths)) < 1e-13
    # causality: changing the last token of a document changes nothing before it
    k2 = k.clone()
    k2[36] += 1.0  # second to last token of the 30-token document (rows 8..37): only rows 36, 37 may change
    out2 = packed_causal_attention(q, k2, v, _cu_seqlens(lengths))
    assert torch.equal(out2[:36], out[:36]) and not torch.equal(out2[36:38], out[36:38])
    assert torch.equal(out2[38:], out[38:])


def test_local_cp_attention_keeps_dtype_and_matches_in_bfloat16():
    gen = torch.Generator().manual_seed(5)
    lengths = [3, 50, 17]
    shard = shard_microbatch(lengths, 1, 0)
    q, k, v = (torch.randn(sum(lengths), h, 16, generator=gen).bfloat16() for h in (4, 2, 2))
    out = cp_attention(shard.take(q), shard.take(k), shard.take(v), shard, None)
    assert out.dtype == torch.bfloat16
    ref = shard.take(packed_causal_attention(q.double(), k.double(), v.double(), _cu_seqlens(lengths)))
    rows = shard.valid_mask
    assert max_rel_err(out.double()[rows], ref[rows]) < 1e-2


@pytest.mark.parametrize("cp_size", [1, 2, 3])
def test_query_tiles_cover_every_local_row_once(cp_size):
    lengths = [1, 3, 700, 2, 2, 5, 1500, 9]
    shard = shard_microbatch(lengths, cp_size, cp_size - 1)
    covered = []
    for q0, q1, d0, d1 in attention_blocks.query_tiles(shard):
        assert 0 < q1 - q0 <= attention_blocks.QUERY_TILE_ROWS
        assert set(shard.doc_ids[q0:q1].tolist()) <= set(range(d0, d1))
        covered += range(q0, q1)
    assert covered == list(range(shard.num_local_tokens))


def test_cp_attention_rejects_bad_arguments():
    shard = shard_microbatch([4, 6], 1, 0)
    t = shard.num_local_tokens
    q, kv = torch.zeros(t, 4, 8), torch.zeros(t, 2, 8)
    with pytest.raises(ValueError, match="impl"):
        cp_attention(q, kv, kv, shard, None, impl="flash")
    with pytest.raises(ValueError, match="rows"):
        cp_attention(q[:-1], kv[:-1], kv[:-1], shard, None)
    with pytest.raises(ValueError, match="kv heads"):
        cp_attention(torch.zeros(t, 3, 8), kv, kv, shard, None)
    with pytest.raises(ValueError, match="cp_size=2"):
        cp_attention(q, kv, kv, shard_microbatch([4, 6], 2, 0), None)
