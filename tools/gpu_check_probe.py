"""gpu_check's te_attention step (run by tools/gpu_check.py --probe DIR on a GPU; writes DIR/te_attention.json).

1. Transformer Engine's DotProductAttention on packed THD documents (bf16, causal, CP 1), laid out as DCP lays
   them out (runtime.sharding: every document padded to a multiple of 2; the padded bounds as cu_seqlens, as
   pretrain_gpt.py passes them), against our reference attention
   (runtime.cp_attention.packed_causal_attention) in fp32 on the same inputs: output and the gradients of q, k, v on the documents' rows, each error taken relative to the
   reference's largest magnitude.
2. The device memory one NCCL communicator takes: free memory before and after a 1-rank group's first
   all-reduce (a lower bound of the planner's per-communicator reserve; multi-rank groups need more GPUs).
"""
from __future__ import annotations

import json
import os
import sys

DOC_LENGTHS = (1, 7, 128, 1000, 2047, 3001)   # odd lengths: padding rows between documents
HEADS, KV_HEADS, HEAD_DIM = 8, 4, 128


def _rel(x, ref) -> float:
    return float((x.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12))


def attention_errors() -> dict:
    import torch
    from transformer_engine.pytorch import DotProductAttention

    from dcp_megatron.runtime.cp_attention import packed_causal_attention
    from dcp_megatron.runtime.sharding import shard_microbatch

    torch.manual_seed(0)
    shard = shard_microbatch(DOC_LENGTHS, 1, 0)
    rows = shard.num_local_tokens
    device = torch.device("cuda", torch.cuda.current_device())
    q = torch.randn(rows, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(rows, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(rows, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16, requires_grad=True)
    cu_padded = torch.tensor([0, *torch.tensor(shard.padded_lengths).cumsum(0).tolist()], dtype=torch.int32,
                             device=device)
    attention = DotProductAttention(HEADS, HEAD_DIM, num_gqa_groups=KV_HEADS, attention_dropout=0.0,
                                    qkv_format="thd", attn_mask_type="padding_causal").to(device)
    # as pretrain_gpt.py hands them over: the padded bounds as both (padding sits after each document's tokens,
    # so under the causal mask it changes none of their rows)
    out = attention(q, k, v, cu_seqlens_q=cu_padded, cu_seqlens_kv=cu_padded, cu_seqlens_q_padded=cu_padded,
                    cu_seqlens_kv_padded=cu_padded, max_seqlen_q=max(shard.padded_lengths),
                    max_seqlen_kv=max(shard.padded_lengths)).view(rows, HEADS, HEAD_DIM)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)

    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = packed_causal_attention(*ref_in, cu_padded.cpu().long())
    ref.backward(grad_out.float())
    valid = shard.valid_mask.to(device)
    errors = {"forward": _rel(out[valid], ref[valid])}
    for name, ours, theirs in zip(("dq", "dk", "dv"), (q, k, v), ref_in):
        errors[name] = _rel(ours.grad[valid], theirs.grad[valid])
    return {"doc_lengths": list(DOC_LENGTHS), "errors": errors, "max_rel_error": max(errors.values()),
            "backend": os.environ.get("NVTE_FUSED_ATTN", "TE default")}


def communicator_bytes() -> int:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        group = dist.new_group([0])
        dist.all_reduce(torch.ones(1, device="cuda"), group=group)
        torch.cuda.synchronize()
        return int(free_before - torch.cuda.mem_get_info()[0])
    finally:
        dist.destroy_process_group()


def probe(out_dir: str) -> int:
    os.makedirs(out_dir, exist_ok=True)
    result = attention_errors()
    try:
        result["nccl_communicator_bytes_1rank"] = communicator_bytes()
    except Exception as err:   # reported, not fatal: the attention numbers are the check
        result["nccl_communicator_error"] = f"{type(err).__name__}: {err}"
    with open(os.path.join(out_dir, "te_attention.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(probe(sys.argv[1]))
