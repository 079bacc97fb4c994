"""The Transformer Engine attention path (GPU only; skipped without a GPU and TE).

TE's `TEDotProductAttention` must compute, on our THD micro-batch layout (documents padded to
2c, `cu_seqlens_q_padded` global), what our own attention computes, when the per-micro-batch
metadata arrives through `ShardPackedSeqParams` with `local_cp_size=1` and no group (the
dynamic "CP off" seam of megatron-core 0.16.1). Run by tools/gpu_check.sh on a GPU machine.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")
if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)
pytest.importorskip("transformer_engine")

from dcp_megatron.megatron.packed_params import shard_packed_seq_params  # noqa: E402
from dcp_megatron.runtime.cp_attention import cp_attention  # noqa: E402
from dcp_megatron.runtime.sharding import shard_microbatch  # noqa: E402


@pytest.fixture(scope="module")
def te_attention():
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from dcp_megatron.megatron.patch_set import megatron_patch_registry

    config = TransformerConfig(num_layers=1, hidden_size=256, num_attention_heads=8, num_query_groups=4,
                               bf16=True, params_dtype=torch.bfloat16, attention_dropout=0.0)
    with megatron_patch_registry():
        # The patch gives TE a CP stream although the static CP size is 1 (dynamic groups need it).
        assert TEDotProductAttention.cp_stream is not None
        module = TEDotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                       attention_type="self")
        yield module, AttnMaskType.causal


@pytest.mark.parametrize("lengths", [[7, 130, 1], [512], [33, 64, 200, 5]])
def test_te_attention_matches_our_attention_on_padded_thd_shards(te_attention, lengths):
    module, mask_type = te_attention
    shard = shard_microbatch(lengths, 1, 0)
    params = shard_packed_seq_params(shard, None, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(sum(lengths))
    rows = shard.num_local_tokens
    q = torch.randn(rows, 8, 32, device="cuda", generator=gen, dtype=torch.bfloat16)
    k = torch.randn(rows, 4, 32, device="cuda", generator=gen, dtype=torch.bfloat16)
    v = torch.randn(rows, 4, 32, device="cuda", generator=gen, dtype=torch.bfloat16)
    out = module(q, k, v, None, mask_type, packed_seq_params=params).reshape(rows, 8, 32).float()
    ref = cp_attention(q.float(), k.float(), v.float(), shard, None)
    valid = shard.valid_mask.cuda()
    torch.testing.assert_close(out[valid], ref[valid], rtol=2e-2, atol=2e-2)
