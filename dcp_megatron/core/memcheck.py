"""One micro-batch of megatron-core's real GPT stack at real shapes on the `meta` device: its bytes, measured.

`measure(shape, relief, tokens=...)` builds megatron-core 0.19.2's GPTModel (the local layer spec, bf16 weights as
Float16Module makes them, `shape.num_layers` layers, the output layer and the vocab-parallel cross entropy) on
the `meta` device, so nothing is allocated, and runs one THD-packed micro-batch of `documents` through forward,
loss and backward with the relief set as megatron-core sets it (TransformerConfig's `recompute_granularity`,
`recompute_modules`, block recompute of the first k layers). It returns, per layer and for the output layer, the
bytes saved for backward (runtime/memory_probe.py: each storage once) and the peak of live bytes.

Core attention: megatron-core's local `DotProductAttention` refuses THD input (and keeps the L x L
probabilities), so the stack runs `FlashLikeAttention`, which keeps what a flash-attention kernel keeps: the q, k, v
it is handed (as they are: a view keeps its whole storage, as `flash_attn_varlen_func` does for inputs whose last
dimension is contiguous), its output and the softmax log-sum-exp (fp32, per head and token). Offload (megatron-core's
fine-grained activation offloading needs CUDA streams) is not run: `offloaded_bytes` reads, from the same forward,
the bytes saved only inside the modules whose inputs an offload group takes (attention.py: `core_attn` the core
attention's, `attn_proj` linear_proj's), which is what that group frees; the tool applies megatron-core's margin.
"""
from __future__ import annotations

import dataclasses
import os

import torch

from torch.utils._python_dispatch import TorchDispatchMode

from dcp_megatron.planner.costmodel import ModelShape
from dcp_megatron.planner.plan import Recompute
from dcp_megatron.runtime.memory_probe import LiveBytes, SavedBytes, drop_weight_grads

# the modules an offload group of megatron-core 0.19.2 wraps, by offload name (attention.py)
OFFLOAD_SCOPES = {"core_attn": "core_attention", "attn_proj": "linear_proj"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Measured:
    tokens: int
    layer_saved: tuple[int, ...]        # bytes each layer saved for backward
    output_saved: int                   # final norm, output layer and loss
    peak: int                           # live bytes over forward, loss and backward (weights not counted)
    offloadable: dict                   # {offload set (sorted names): bytes per layer saved only in its modules}
    largest: tuple                      # the middle layer's saved storages: (shape, dtype, bytes, modules)


class _FlashLike(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class BalancedRouting(TorchDispatchMode):
    """Answers the token counts an MoE dispatcher copies to the host (`.tolist()` of meta tensors have no data)
    as perfectly balanced routing: every expert gets tokens x top-k / experts rows. Any other read of meta data
    fails as it would without this mode."""

    def __init__(self, rows_per_expert: int, num_experts: int) -> None:
        super().__init__()
        self.rows_per_expert, self.num_experts = rows_per_expert, num_experts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        source = args[0] if args else None
        if (func is torch.ops.aten._to_copy.default and isinstance(source, torch.Tensor) and source.is_meta
                and str(kwargs.get("device", "meta")) == "cpu" and not source.is_floating_point()
                and source.numel() % self.num_experts == 0):
            return torch.full(source.shape, self.rows_per_expert * self.num_experts // source.numel(),
                              dtype=kwargs.get("dtype") or source.dtype)
        return func(*args, **kwargs)


def flash_like_attention_class():
    from megatron.core.transformer.module import MegatronModule

    class FlashLikeAttention(MegatronModule):
        """Keeps what a flash-attention kernel keeps (the module docstring); computes nothing (meta tensors)."""

        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, cp_comm_type=None, pg_collection=None, k_channels=None, v_channels=None):
            super().__init__(config=config)

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            return _FlashLike.apply(query, key, value).reshape(query.shape[0], -1)

    return FlashLikeAttention


def transformer_config(shape: ModelShape, relief: Recompute, *, fused_swiglu: bool):
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    fields = dict(num_layers=shape.num_layers, hidden_size=shape.hidden_size, num_attention_heads=shape.num_heads,
                  num_query_groups=shape.num_kv_heads, kv_channels=shape.head_dim,
                  ffn_hidden_size=shape.ffn_hidden_size, gated_linear_unit=shape.gated_mlp,
                  activation_func=torch.nn.functional.silu, normalization="RMSNorm", add_bias_linear=False,
                  hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
                  perform_initialization=False, bf16=True, params_dtype=torch.bfloat16,
                  bias_activation_fusion=fused_swiglu, apply_rope_fusion=False, masked_softmax_fusion=False,
                  persist_layer_norm=False, gradient_accumulation_fusion=False, calculate_per_token_loss=True)
    if shape.is_moe:
        fields.update(num_moe_experts=shape.num_experts, moe_router_topk=shape.moe_topk,
                      moe_ffn_hidden_size=shape.moe_ffn_hidden_size or shape.ffn_hidden_size,
                      moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.0)
    if relief.kind == "full":
        fields.update(recompute_granularity="full", recompute_method="block", recompute_num_layers=relief.full_layers)
    elif relief.modules:
        fields.update(recompute_granularity="selective", recompute_modules=sorted(relief.modules))
    if shape.mla is not None:     # plain RoPE: YaRN's tables move to CUDA
        mla = shape.mla
        fields.update(multi_latent_attention=True, q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank,
                      qk_head_dim=mla.qk_head_dim, qk_pos_emb_head_dim=mla.qk_pos_emb_head_dim,
                      v_head_dim=mla.v_head_dim, qk_layernorm=mla.qk_layernorm, rope_type="rope")
        return MLATransformerConfig(**fields)
    return TransformerConfig(**fields)


def build_model(shape: ModelShape, relief: Recompute, *, fused_swiglu: bool):
    """megatron-core's GPTModel on the meta device (model-parallel state initialised by the caller)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    mla = shape.mla is not None
    spec = get_gpt_layer_local_spec(num_experts=shape.num_experts or None, normalization="RMSNorm",
                                    multi_latent_attention=mla, qk_layernorm=mla and shape.mla.qk_layernorm)
    spec.submodules.self_attention.submodules.core_attention = flash_like_attention_class()
    config = transformer_config(shape, relief, fused_swiglu=fused_swiglu)
    with torch.device("meta"):   # MLA's attention holds its own rotary embedding
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=shape.vocab_size,
                         max_sequence_length=1 << 20, position_embedding_type="none" if mla else "rope",
                         share_embeddings_and_output_weights=False)
    model.bfloat16()                           # what Float16Module does to the whole model under --bf16
    # RoPE's frequencies are computed on the CPU (a real table, small); the activations are meta
    tables = [layer.self_attention.rotary_pos_emb for layer in model.decoder.layers] if mla else [model.rotary_pos_emb]
    for table in tables:
        table.register_forward_hook(lambda module, args, out: out.to("meta"))
    return model


def _scoped(model, saved: SavedBytes) -> None:
    """Buckets by layer (and the output layer), scopes by the modules an offload group wraps."""
    def bucket(name):
        def hook(module, args):
            saved.bucket = name
        return hook

    for i, layer in enumerate(model.decoder.layers):
        layer.register_forward_pre_hook(bucket(f"layer{i}"))
        for offload, attr in OFFLOAD_SCOPES.items():
            module = getattr(layer.self_attention, attr)
            module.register_forward_pre_hook(lambda m, a, name=offload: saved.enter_scope(name))
            module.register_forward_hook(lambda m, a, o: saved.exit_scope())
    model.decoder.final_layernorm.register_forward_pre_hook(bucket("output"))


def measure(shape: ModelShape, relief: Recompute, *, documents: list[int], fused_swiglu: bool = True) -> Measured:
    """Bytes of one micro-batch of `documents` (lengths, THD-packed) through `shape` with `relief`."""
    from megatron.core.packed_seq_params import PackedSeqParams

    model = build_model(shape, relief, fused_swiglu=fused_swiglu)
    model.train()
    weights = list(model.parameters())
    tokens = sum(documents)
    bounds = torch.tensor([0, *torch.tensor(documents).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds,
                             max_seqlen_q=max(documents), max_seqlen_kv=max(documents))
    ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    saved = SavedBytes(exclude=weights)
    _scoped(model, saved)
    live = LiveBytes(exclude=weights)
    # eager kernels: a compiled fused function would trace the probes themselves
    routing = BalancedRouting(tokens * shape.moe_topk // (shape.num_experts or 1), shape.num_experts or 1)
    with torch._dynamo.config.patch(disable=True), routing, live:
        with saved:
            loss = model(ids, ids, None, labels=ids, packed_seq_params=params)
        live.mark("forward")
        by_bucket = saved.bytes_by_bucket()
        middle = f"layer{shape.num_layers // 2}"
        largest = tuple(saved.tensors(middle))
        offloadable = {names: saved.bytes_saved_only_in(middle, names)
                       for names in (("core_attn",), ("attn_proj", "core_attn"))}
        saved.release()
        hooks = drop_weight_grads(weights, live)
        loss.sum().backward()
        live.mark("backward")
        for hook in hooks:
            hook.remove()
    return Measured(tokens=tokens, layer_saved=tuple(by_bucket.get(f"layer{i}", 0) for i in range(shape.num_layers)),
                    output_saved=by_bucket.get("output", 0), peak=live.peak, offloadable=offloadable,
                    largest=largest)


def init_single_process() -> None:
    """A one-rank gloo world and megatron-core's model-parallel state (TP = PP = CP = 1)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1)
