"""Shape of the transformer being trained: all the planner needs to know about the model."""
from __future__ import annotations

from dataclasses import dataclass, replace

from dcp_megatron.planner.costmodel.memory_spec import LOCAL_BF16, TRANSFORMER_ENGINE, ActivationSpec
from dcp_megatron.planner.costmodel.mla import MlaShape


# The spec of a shape that names none: TE's (read from its sources) for a TE run; for "local", the local spec's
# measured count at bf16 widths with our CPU attention (runs pass their own: core/planning.activation_spec_of)
DEFAULT_SPECS = {"transformer_engine": TRANSFORMER_ENGINE, "local": replace(LOCAL_BF16, attention="cpu")}


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    gated_mlp: bool = True  # SwiGLU: three ffn matrices instead of two
    tp: int = 1
    pp: int = 1
    ep: int = 1   # expert parallelism: MoE all-to-alls pair up micro-batches across the EP group
    # Mixture-of-Experts (every layer's MLP; Megatron's --num-experts, --moe-router-topk, --moe-ffn-hidden-size)
    num_experts: int | None = None        # 0 / None: a dense model
    moe_topk: int = 2                     # experts each token is routed to
    moe_ffn_hidden_size: int | None = None   # one expert's FFN width; None: ffn_hidden_size
    # --moe-shared-expert-intermediate-size: a dense MLP of this width every token of an MoE layer runs beside its
    # routed experts (held whole on every rank, split over tp only); None: none
    moe_shared_expert_size: int | None = None
    # --moe-layer-freq's dense layers (its 0 entries): of num_layers, how many run a dense MLP of ffn_hidden_size
    # instead of the experts (DeepSeek's first layers); counted as such in weights, FLOPs and the layers' saved
    # tensors (cost_memory.py: the stage holding the most)
    num_dense_layers: int = 0
    # ZeRO stage over the DCP domain (param_sharding.py); None: the cluster's distributed_optimizer (1 or 0)
    zero_stage: int | None = None
    # What the layers keep for backward (memory_spec.py): megatron-core's --transformer-impl and
    # --sequence-parallel (norm inputs and outputs are split over tp only with it)
    transformer_impl: str = "transformer_engine"   # or "local" (our CPU runs)
    sequence_parallel: bool = True
    # The run's activation dtype and kernels, counted tensor by tensor (memory_spec.py); None: the default spec
    # of `transformer_impl` (`activation_spec`)
    activations: ActivationSpec | None = None
    # Multi-latent attention (planner/costmodel/mla.py; Megatron's --multi-latent-attention): None, plain attention
    mla: MlaShape | None = None
    # Multi-token prediction (--mtp-num-layers): each one more transformer layer, its projection and norms, and
    # the output layer and loss once more, on the last pipeline stage
    mtp_num_layers: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                     "ffn_hidden_size", "vocab_size", "tp", "pp", "ep", "moe_topk"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelShape.{name} must be a positive int, got {value!r}")
        self._check_moe()
        if self.zero_stage is not None and (isinstance(self.zero_stage, bool) or self.zero_stage not in (0, 1, 2, 3)):
            raise ValueError(f"ModelShape.zero_stage must be None or 0-3, got {self.zero_stage!r}")
        if self.transformer_impl not in ("transformer_engine", "local"):
            raise ValueError(f"ModelShape.transformer_impl must be 'transformer_engine' or 'local', "
                             f"got {self.transformer_impl!r}")
        if self.activations is not None and not isinstance(self.activations, ActivationSpec):
            raise ValueError(f"ModelShape.activations must be None or an ActivationSpec, got {self.activations!r}")
        if self.mla is not None and not isinstance(self.mla, MlaShape):
            raise ValueError(f"ModelShape.mla must be None or an MlaShape, got {self.mla!r}")
        if self.mla is not None and self.num_kv_heads != self.num_heads:
            raise ValueError(f"ModelShape.num_kv_heads={self.num_kv_heads} with MLA: every head has its own key and "
                             f"value, set num_kv_heads = num_heads ({self.num_heads})")
        if not isinstance(self.mtp_num_layers, int) or isinstance(self.mtp_num_layers, bool) or self.mtp_num_layers < 0:
            raise ValueError(f"ModelShape.mtp_num_layers must be an int >= 0, got {self.mtp_num_layers!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.num_heads % self.tp:
            raise ValueError(f"num_heads={self.num_heads} is not divisible by tp={self.tp}")
        if self.num_layers % self.pp:
            raise ValueError(f"num_layers={self.num_layers} is not divisible by pp={self.pp}")

    def _check_moe(self) -> None:
        dense = self.num_dense_layers
        if not isinstance(dense, int) or isinstance(dense, bool) or not 0 <= dense <= self.num_layers:
            raise ValueError(f"ModelShape.num_dense_layers must be an int in [0, num_layers={self.num_layers}], "
                             f"got {dense!r}")
        if dense and not self.is_moe:
            raise ValueError("ModelShape.num_dense_layers counts an MoE model's dense layers: set num_experts")
        if self.num_experts is not None and (not isinstance(self.num_experts, int) or self.num_experts < 0):
            raise ValueError(f"ModelShape.num_experts must be None or an int >= 0, got {self.num_experts!r}")
        width = self.moe_ffn_hidden_size
        if width is not None and (not isinstance(width, int) or width <= 0):
            raise ValueError(f"ModelShape.moe_ffn_hidden_size must be None or a positive int, got {width!r}")
        shared = self.moe_shared_expert_size
        if shared is not None and (not isinstance(shared, int) or shared <= 0):
            raise ValueError(f"ModelShape.moe_shared_expert_size must be None or a positive int, got {shared!r}")
        if shared is not None and not self.is_moe:
            raise ValueError("ModelShape.moe_shared_expert_size needs experts: set num_experts (a dense model's MLP "
                             "is ffn_hidden_size)")
        if not self.is_moe:
            if self.ep > 1:
                raise ValueError(f"ModelShape.ep={self.ep} needs experts: set num_experts (a dense model has no EP)")
            return
        if self.moe_topk > self.num_experts:
            raise ValueError(f"ModelShape.moe_topk={self.moe_topk} exceeds num_experts={self.num_experts}")
        if self.num_experts % self.ep:
            raise ValueError(f"ModelShape.ep={self.ep} does not divide num_experts={self.num_experts}")

    @property
    def activation_spec(self) -> ActivationSpec:
        """The spec the memory count uses: the shape's own, else its transformer_impl's default."""
        return self.activations if self.activations is not None else DEFAULT_SPECS[self.transformer_impl]

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    @property
    def lockstep(self) -> bool:
        """Every rank of the domain must run the same number of micro-batches, one per group per wave: PP's 1F1B
        interleaves them across stages, and EP's all-to-alls (per MoE layer, forward and backward) pair the
        micro-batches of the EP group's ranks, whatever CP group each belongs to; ZeRO-3 / FSDP all-gathers
        every layer's weights over the whole domain in every forward and backward."""
        return self.pp > 1 or self.ep > 1 or self.zero_stage == 3

    @property
    def wave_uniform_relief(self) -> bool:
        """Every micro-batch of a wave (an idle rank's filler too) must run one relief: ZeRO-3 gathers a layer's
        weights on every rank of the domain each time the layer runs, so a layer one rank replays in backward (full
        recompute) or a module only some ranks rerun breaks the gathers' pairing (docs/deepspeed.md)."""
        return self.zero_stage == 3

    # ---- attention head dims -------------------------------------------------------------
    @property
    def score_head_dim(self) -> int:
        """A query's and a key's head dim (what QK^T contracts over): MLA's no-rope + rope dims."""
        return self.mla.q_head_dim if self.mla is not None else self.head_dim

    @property
    def value_head_dim(self) -> int:
        """A value's head dim (PV's and the output projection's): MLA's v_head_dim."""
        return self.mla.v_head_dim if self.mla is not None else self.head_dim

    @property
    def kernel_value_head_dim(self) -> int:
        """The value head dim the attention kernel runs at: megatron-core 0.19.2's MLA pads THD values with zeros to
        the q/k head dim and trims the output after (multi_latent_attention.py, `_prepare_mla_core_attention_value`);
        our CPU attention drops the zero columns again (docs/megatron.md)."""
        if self.mla is None:
            return self.head_dim
        return self.value_head_dim if self.activation_spec.attention == "cpu" else self.score_head_dim

    @property
    def layers_with_mtp(self) -> int:
        """Transformer layers a token runs through: the decoder's and the MTP layers'."""
        return self.num_layers + self.mtp_num_layers

    # ---- parameter counts (whole model, before TP/PP split) ------------------------------
    @property
    def attn_params_per_layer(self) -> int:
        if self.mla is not None:
            return self.mla.attn_params(self.hidden_size, self.num_heads)
        q_out = self.num_heads * self.head_dim
        kv_out = 2 * self.num_kv_heads * self.head_dim
        return self.hidden_size * (q_out + kv_out) + q_out * self.hidden_size

    @property
    def expert_mlp_params(self) -> int:
        """One MLP's weights: the dense MLP, or one expert of width moe_ffn_hidden_size."""
        width = (self.moe_ffn_hidden_size or self.ffn_hidden_size) if self.is_moe else self.ffn_hidden_size
        return (3 if self.gated_mlp else 2) * self.hidden_size * width

    @property
    def shared_expert_params(self) -> int:
        """A layer's shared expert's weights (0 without one)."""
        return (3 if self.gated_mlp else 2) * self.hidden_size * (self.moe_shared_expert_size or 0)

    @property
    def router_params_per_layer(self) -> int:
        return self.hidden_size * self.num_experts if self.is_moe else 0

    @property
    def num_moe_layers(self) -> int:
        """Layers whose MLP is the experts (MTP layers included); 0 for a dense model."""
        return self.layers_with_mtp - self.num_dense_layers if self.is_moe else 0

    @property
    def dense_mlp_params(self) -> int:
        """A dense MLP's weights (ffn_hidden_size wide): a dense model's layers and an MoE model's dense ones."""
        return (3 if self.gated_mlp else 2) * self.hidden_size * self.ffn_hidden_size

    @property
    def mlp_params(self) -> int:
        """Stored MLP weights of all layers (MTP's included), each counted as what it is (dense or MoE)."""
        if not self.is_moe:
            return self.layers_with_mtp * self.dense_mlp_params
        return self.num_moe_layers * self.mlp_params_per_layer + self.num_dense_layers * self.dense_mlp_params

    @property
    def active_mlp_params(self) -> int:
        """MLP weights one token multiplies over all layers, each counted as what it is."""
        if not self.is_moe:
            return self.layers_with_mtp * self.dense_mlp_params
        return self.num_moe_layers * self.active_mlp_params_per_layer + self.num_dense_layers * self.dense_mlp_params

    @property
    def mlp_params_per_layer(self) -> int:
        """Stored MLP weights of a layer: the dense MLP, or the router, every expert and the shared one."""
        if not self.is_moe:
            return self.expert_mlp_params
        return self.router_params_per_layer + self.num_experts * self.expert_mlp_params + self.shared_expert_params

    @property
    def active_mlp_params_per_layer(self) -> int:
        """MLP weights one token multiplies: the dense MLP, or the router, its top-k experts and the shared one."""
        if not self.is_moe:
            return self.expert_mlp_params
        return self.router_params_per_layer + self.moe_topk * self.expert_mlp_params + self.shared_expert_params

    @property
    def expert_params(self) -> int:
        """All experts' weights over all layers (0 for a dense model): split over EP, not replicated."""
        return self.num_moe_layers * self.num_experts * self.expert_mlp_params if self.is_moe else 0

    @property
    def mtp_projection_params(self) -> int:
        """The MTP layers' projections of [embedding, hidden state] (2h) to h."""
        return self.mtp_num_layers * 2 * self.hidden_size * self.hidden_size

    @property
    def linear_params(self) -> int:
        """Weights of the matmuls (layers, MTP layers + output layer, which MTP shares), every expert counted."""
        return (self.layers_with_mtp * self.attn_params_per_layer + self.mlp_params + self.mtp_projection_params
                + self.hidden_size * self.vocab_size)

    @property
    def active_linear_params(self) -> int:
        """Weights one token multiplies (layers, MTP layers + output layer, once more per MTP layer):
        linear_params with top-k of the experts."""
        return (self.layers_with_mtp * self.attn_params_per_layer + self.active_mlp_params + self.mtp_projection_params
                + (1 + self.mtp_num_layers) * self.hidden_size * self.vocab_size)

    def params_per_rank(self, params: int) -> float:
        """A count of the model's weights (experts among them counted in full) held by one rank: everything
        split over tp x pp, the experts' share over ep too (each rank holds num_experts / ep of them)."""
        dense = params - self.expert_params
        assert dense >= 0, (params, self.expert_params)
        return dense / (self.tp * self.pp) + self.expert_params / (self.tp * self.pp * self.ep)

    @property
    def num_params(self) -> int:
        latent_norms = self.mla.norm_params if self.mla is not None else 0
        # two per layer and the final one; an MTP layer's embedding, hidden-state and final norms besides
        norms = (self.layers_with_mtp * (2 * self.hidden_size + latent_norms) + self.hidden_size
                 + self.mtp_num_layers * 3 * self.hidden_size)
        return self.linear_params + self.hidden_size * self.vocab_size + norms  # + embedding

    # ---- FLOPs (forward + backward) ------------------------------------------------------
    @property
    def linear_flops_per_token(self) -> float:
        """6 FLOPs per linear parameter per token (2 forward, 4 backward); an MoE layer's MLP counts the
        router and the top-k experts a token visits."""
        return 6.0 * self.active_linear_params

    @property
    def attn_flops_per_len2(self) -> float:
        """Causal attention FLOPs per L^2 of one document, forward + backward, MTP layers included.

        QK^T is 2·L²·d_qk and PV 2·L²·d_v per head non-causal (d_v as the kernel runs it: MLA's THD padding);
        causal halves that; backward is 2x forward: 3·layers·heads·(d_qk + d_v) (6·layers·heads·d_head where the
        two are equal)."""
        return 3.0 * self.layers_with_mtp * self.num_heads * (self.score_head_dim + self.kernel_value_head_dim)

    def dense_layer_shape(self) -> "ModelShape":
        """This model with a dense MLP of ffn_hidden_size in every layer: what one of its dense layers keeps."""
        return replace(self, num_experts=None, moe_ffn_hidden_size=None, moe_shared_expert_size=None, ep=1,
                       num_dense_layers=0)

    def with_parallel(self, *, tp: int, pp: int, ep: int = 1) -> "ModelShape":
        return replace(self, tp=tp, pp=pp, ep=ep)


def ulysses_supported(num_heads: int, num_kv_heads: int, cp_size: int) -> bool:
    """Whether Ulysses CP attention can split these (per-TP-rank) heads over a group of cp_size: the query
    heads must divide evenly (key/value heads are split too when they divide, else replicated)."""
    return cp_size >= 1 and num_heads % cp_size == 0 and num_heads % num_kv_heads == 0


def kv_heads_exchanged(num_heads: int, num_kv_heads: int, cp_size: int) -> int:
    """Key/value heads a Ulysses all-to-all moves per row: split when c divides them, else all query heads'."""
    return num_kv_heads if num_kv_heads % cp_size == 0 else num_heads


MODEL_PRESETS: dict[str, ModelShape] = {
    # The CPU demo model: small enough to train on 2 cores, byte-level vocabulary.
    "gpt-tiny": ModelShape(num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32,
                           ffn_hidden_size=384, vocab_size=512),
    # The demo model with 4 experts per layer, top-2 (tests and CPU runs of MoE layouts).
    "gpt-tiny-moe": ModelShape(num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32,
                               ffn_hidden_size=384, vocab_size=512, num_experts=4, moe_topk=2),
    # Llama-3 8B / 70B public configs.
    "llama3-8b": ModelShape(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                            ffn_hidden_size=14336, vocab_size=128256),
    "llama3-70b": ModelShape(num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8, head_dim=128,
                             ffn_hidden_size=28672, vocab_size=128256),
    # Qwen2.5-32B public config (32.8B parameters): the 32B-class dense model of the ZeRO-3 tables.
    "qwen2.5-32b": ModelShape(num_layers=64, hidden_size=5120, num_heads=40, num_kv_heads=8, head_dim=128,
                              ffn_hidden_size=27648, vocab_size=152064),
    # Mixtral-8x7B public config: 8 experts of Mistral-7B's MLP per layer, top-2 routing (46.7B parameters,
    # 12.9B active per token).
    "mixtral-8x7b": ModelShape(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                               ffn_hidden_size=14336, vocab_size=32000, num_experts=8, moe_topk=2),
    # DeepSeek-V3's layer (public config: MLA with a 1536 q / 512 kv latent, 128 heads of 128 + 64 rope q/k dims
    # and 128 v dims; 256 experts of width 2048, top-8, and one shared expert of width 2048; one MTP layer) at 16
    # layers instead of 61, so that its weights fit an H200 at EP 64 (198B parameters, 11.9B active per token;
    # 91 GB of static state per rank on a 64-GPU domain); every layer MoE (V3's three dense first layers are not
    # modelled).
    "deepseek-v3-like": ModelShape(num_layers=16, hidden_size=7168, num_heads=128, num_kv_heads=128, head_dim=128,
                                   ffn_hidden_size=18432, vocab_size=129280, num_experts=256, moe_topk=8,
                                   moe_ffn_hidden_size=2048, moe_shared_expert_size=2048, mtp_num_layers=1,
                                   mla=MlaShape(q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128,
                                                qk_pos_emb_head_dim=64, v_head_dim=128, qk_layernorm=True)),
}


def model_preset(name: str, *, tp: int = 1, pp: int = 1, ep: int = 1) -> ModelShape:
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(MODEL_PRESETS)}")
    return MODEL_PRESETS[name].with_parallel(tp=tp, pp=pp, ep=ep)
