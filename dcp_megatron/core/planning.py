"""The cost model of a Megatron run and one StepPlan per global batch.

Every rank builds the same cost model from the same flags and plans the same global batch, so
all ranks hold the same plan without communicating (docs/design.md; on large domains each rank plans a part and
the parts are gathered: core/split_planning.py); one all-reduced hash per
step proves it (on by default; `--dcp-no-check-plans` turns it off).
"""
from __future__ import annotations

import dataclasses
import hashlib

from dcp_megatron.config import DcpConfig
from dcp_megatron.core.out_of_memory import LIMIT_DIR, capped_memory_bytes
from dcp_megatron.planner.costmodel import CostModel, GpuCosts, MlaShape, ModelShape, cluster_preset, load_profile
from dcp_megatron.planner.costmodel.device_budget import DeviceReading, choose_device_budget, preset_for_device
from dcp_megatron.planner.costmodel.memory_spec import (CPU_FP32, LOCAL_BF16, TRANSFORMER_ENGINE,
                                                        TRANSFORMER_ENGINE_FP8, ActivationSpec)
from dcp_megatron.planner.plan import StepPlan
from dcp_megatron.planner.plan_bytes import plan_to_bytes
from dcp_megatron.planner.policies import make_plan

GiB = 1024 ** 3


def model_shape_from_args(args, *, vocab_size: int | None = None, dtype_bytes: int | None = None) -> ModelShape:
    """The planner's view of Megatron's model flags (after Megatron's validate_args filled defaults);
    `vocab_size` stands in for the padded vocabulary before Megatron has built the tokenizer, `dtype_bytes` for the
    activations' width where the flags do not say it (activation_spec_of)."""
    mla = mla_shape_from_args(args)
    num_kv_heads = (args.num_query_groups if args.group_query_attention and mla is None
                    else args.num_attention_heads)      # MLA: every head its own key and value
    is_moe = bool(getattr(args, "num_experts", None))
    return ModelShape(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_heads=args.num_attention_heads,
        num_kv_heads=num_kv_heads, head_dim=args.kv_channels, ffn_hidden_size=args.ffn_hidden_size,
        vocab_size=vocab_size or args.padded_vocab_size, gated_mlp=bool(args.swiglu),
        tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
        ep=getattr(args, "expert_model_parallel_size", 1) if is_moe else 1,
        # MoE: router + top-k experts in FLOPs, experts / ep in memory, EP all-to-alls (planner/costmodel/moe_cost.py)
        num_experts=getattr(args, "num_experts", None), moe_topk=getattr(args, "moe_router_topk", None) or 2,
        moe_ffn_hidden_size=getattr(args, "moe_ffn_hidden_size", None),
        moe_shared_expert_size=getattr(args, "moe_shared_expert_intermediate_size", None) if is_moe else None,
        num_dense_layers=dense_layers_of(args) if is_moe else 0,
        # what the layers keep for backward depends on the spec and on sequence parallelism (costmodel/memory_spec.py)
        transformer_impl="local" if getattr(args, "transformer_impl", None) == "local" else "transformer_engine",
        sequence_parallel=bool(getattr(args, "sequence_parallel", False)),
        # MLA's head dims and latents, MTP's layers: their FLOPs, weights and saved tensors
        mla=mla, mtp_num_layers=getattr(args, "mtp_num_layers", None) or 0,
        activations=activation_spec_of(args, dtype_bytes=dtype_bytes))


def dense_layers_of(args) -> int:
    """How many of the decoder's layers --moe-layer-freq makes dense: an int N puts the experts on every N-th layer
    (layer i is MoE when i % N == 0), a list (Megatron's parser evaluates "[0]*3+[1]*58") names each layer, 1 MoE
    and 0 dense."""
    from dcp_megatron.config import DcpUsageError

    freq = getattr(args, "moe_layer_freq", 1)
    if isinstance(freq, str):      # not through Megatron's parser (moe_freq_type): its int form only
        freq = int(freq) if freq.strip().isdigit() else freq
    num_layers = args.num_layers
    if isinstance(freq, int) and not isinstance(freq, bool) and freq > 0:
        return sum(1 for i in range(num_layers) if i % freq)
    if isinstance(freq, (list, tuple)) and len(freq) == num_layers and set(freq) <= {0, 1}:
        return sum(1 for x in freq if x == 0)
    raise DcpUsageError(f"--moe-layer-freq {freq!r}: give a positive int or a list of {num_layers} entries "
                        f"(--num-layers), 1 for an MoE layer and 0 for a dense one, e.g. \"[0]*1+[1]*{num_layers - 1}\"")


def mla_shape_from_args(args) -> MlaShape | None:
    """MLA's shape from --multi-latent-attention's flags (None without it)."""
    if not getattr(args, "multi_latent_attention", False):
        return None
    return MlaShape(q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank, qk_head_dim=args.qk_head_dim,
                    qk_pos_emb_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim,
                    qk_layernorm=bool(getattr(args, "qk_layernorm", False)))


def activation_spec_of(args, *, dtype_bytes: int | None = None) -> ActivationSpec:
    """What the run keeps for backward (memory_spec.py) at its precision (`dtype_bytes`: 2 under --bf16 / --fp16, 4
    without: Megatron's default is fp32; the DeepSpeed script passes its JSON's): a CPU fp32 run of the local spec
    is counted as CPU_FP32 (mlp.py's glu under --no-bias-swiglu-fusion); the local spec on a GPU as LOCAL_BF16's
    tensors at the run's width; Transformer Engine's spec otherwise (its FP8 linears' under --fp8-format), at the
    run's width (a CPU run of the local spec in 2 bytes, which no count describes, as TE's)."""
    import torch

    if dtype_bytes is None:
        dtype_bytes = 2 if getattr(args, "bf16", False) or getattr(args, "fp16", False) else 4
    local = getattr(args, "transformer_impl", None) == "local"
    if local and torch.cuda.is_available():
        return dataclasses.replace(LOCAL_BF16, dtype_bytes=dtype_bytes)
    if not local and getattr(args, "fp8", None) is not None:
        return TRANSFORMER_ENGINE_FP8
    if local and dtype_bytes == 4:
        return CPU_FP32 if getattr(args, "bias_swiglu_fusion", True) else dataclasses.replace(CPU_FP32, swiglu="unfused")
    return dataclasses.replace(TRANSFORMER_ENGINE, dtype_bytes=dtype_bytes)


def build_cost_model(config: DcpConfig, model: ModelShape, *, domain_size: int, has_gpu: bool,
                     device: DeviceReading | None = None, say=None) -> CostModel:
    """On GPU the preset and budget the device read at start chooses (costmodel/device_budget.py; `device`: a reading
    to use, else this rank's device is read), "cpu" without; --dcp-* flags and --dcp-profile override it; `say`
    gets the start's lines (what was read, the budget chosen). On GPU the model also charges FP8 GEMMs and weight
    copies, TE's p2p CP ring and NCCL communicators (gpu_costs.py)."""
    if has_gpu and device is None:
        from dcp_megatron.runtime.device_memory import read_device

        device = read_device()
    gpu = GpuCosts(fp8=config.fp8, cp_ring=has_gpu and config.te_attention, communicators=has_gpu)
    profile = load_profile(config.profile) if config.profile else None

    def cost_model(cluster):
        return CostModel(model, cluster, profile=profile, allowed_recompute=config.recompute,
                         cp_attention=config.cp_attention, gpu=gpu)

    reading = device if has_gpu else None
    preset = "cpu" if reading is None else preset_for_device(reading.name, reading.total_bytes)[0]
    cluster = cluster_preset(preset, domain_size=domain_size, gpus_per_node=config.gpus_per_node)
    changes = {}
    if config.max_cp_size is not None:
        changes["max_cp_size"] = config.max_cp_size
    static_bytes = cost_model(dataclasses.replace(cluster, **changes)).static_bytes if reading is not None else 0
    choice = choose_device_budget(reading, static_bytes=static_bytes, memory_budget_gb=config.memory_budget_gb,
                                  device_memory_gb=config.device_memory_gb, safety_frac=cluster.mem_safety_frac)
    if say is not None:
        for line in choice.lines:
            say(line)
    if choice.mem_bytes_per_gpu is not None:
        changes["mem_bytes_per_gpu"] = choice.mem_bytes_per_gpu
    if config.memory_limit_bytes is not None:   # a micro-batch ran out of memory at this count before
        changes["mem_bytes_per_gpu"] = capped_memory_bytes(changes.get("mem_bytes_per_gpu", cluster.mem_bytes_per_gpu),
                                                           safety_frac=cluster.mem_safety_frac,
                                                           limit=config.memory_limit_bytes)
    if changes:
        cluster = dataclasses.replace(cluster, **changes)
    return cost_model(cluster)


def checked_cost_model(config: DcpConfig, model: ModelShape, *, domain_size: int, has_gpu: bool,
                       say=None) -> CostModel:
    """build_cost_model at start-up: a --dcp-profile that is not a valid profile, or a --seq-length document that
    fits no CP group, is a DcpUsageError naming the flags to change."""
    from dcp_megatron.config import DcpUsageError

    try:
        cost = build_cost_model(config, model, domain_size=domain_size, has_gpu=has_gpu, say=say)
    except ValueError as err:   # the profile's own checks (cost_profile.check_profile)
        if config.profile is None:
            raise
        raise DcpUsageError(f"--dcp-profile {config.profile}: {err}") from None
    check_longest_fits(config, cost)
    return cost


def plan_global_batch(config: DcpConfig, sequences, cost: CostModel) -> StepPlan:
    """The plan every rank runs for a global batch [(sequence_id, length)]."""
    return make_plan(config.policy, list(sequences), cost, max_seq_len=config.seq_length,
                     setting=config.policy_setting)


def plan_digest(plan: StepPlan) -> int:
    """56 bits of the SHA-256 of the plan's compact bytes (planner/plan_bytes.py: deterministic, and at 16,384 ranks
    a fifth of the JSON's cost) (fits an int64 with its negation)."""
    return int.from_bytes(hashlib.sha256(plan_to_bytes(plan)).digest()[:7], "little")


def check_same_plan(plan: StepPlan, *, iteration: int, group, device) -> None:
    """Every rank planned the same step (collective over `group`, the default group's timeout for None).

    On by default: ranks running different plans post mismatched collectives, which hang until the timeout or
    silently mix up data. One all-reduce (MAX) of (digest, -digest) yields the largest and smallest digest."""
    import torch
    import torch.distributed as dist

    digest = plan_digest(plan)
    both = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    high, low = int(both[0]), -int(both[1])
    if low != high:
        raise RuntimeError(f"iteration {iteration}: ranks computed different plans (hash {digest:x} here, "
                           f"{low:x}..{high:x} across ranks); planning must be deterministic: same flags, "
                           f"--dcp-profile and code on every rank")


def check_longest_fits(config: DcpConfig, cost: CostModel) -> None:
    """Before the first step: a --seq-length document must fit the domain, else say which flag to change."""
    import numpy as np

    from dcp_megatron.config import DcpUsageError
    from dcp_megatron.planner.layout import candidate_sizes, check_static_memory, min_fitting_size

    try:
        check_static_memory(cost)   # its line names the flags (budget, optimizer sharding, TP/PP): kept whole
        static_problem = ""
    except ValueError as err:
        static_problem = f" ({err})"
    try:
        min_fitting_size(np.array([config.seq_length]), np.array([0]), candidate_sizes(cost.cluster), cost)
    except ValueError:
        # (not the planner's own advice: "e.g. full" recompute, which EP > 1 forbids, and its batcher's options)
        # Advise full recompute only where it may run: EP > 1 takes it out (layout_checks._without_full_recompute).
        if "full" in cost.allowed_recompute:
            recompute = ""
        elif cost.model.ep > 1:
            recompute = f" (full recompute is off under --expert-model-parallel-size {cost.model.ep})"
        else:
            recompute = ", allow full recompute (--dcp-recompute)"
        raise DcpUsageError(
            f"a --seq-length {config.seq_length} document fits no CP group of this {cost.cluster.domain_size}-rank "
            f"domain (largest allowed group {candidate_sizes(cost.cluster)[-1]}) within "
            f"{_budget_words(config, cost)} with recompute {'/'.join(cost.allowed_recompute)}: "
            f"{_what_would_fit(config, cost, recompute)}{static_problem}") from None
    check_policy_setting(config, cost)


def _what_would_fit(config: DcpConfig, cost: CostModel, recompute: str) -> str:
    """The changes that would pass check_longest_fits, each with the value that would do (planner/start_fit.py)."""
    from dcp_megatron.planner.start_fit import budget_gb_that_fits, smallest_domain_size, smallest_max_cp_size

    seq = config.seq_length
    if config.memory_limit_bytes is not None:      # a larger budget does not lift the records' cap (said above)
        options = [recompute[2:]] if recompute.startswith(", ") else []
    else:
        need = budget_gb_that_fits(cost, seq)
        options = [f"raise --dcp-memory-budget-gb to at least {need:g}{recompute}" if need is not None else
                   f"no --dcp-memory-budget-gb holds it at this CP size{recompute}"]
    if cost.cluster.cp_size_limit < cost.cluster.domain_size:
        cp = smallest_max_cp_size(cost, seq)
        if cp is not None:
            options.append(f"raise --dcp-max-cp-size to {cp}")
    options.append("lower --seq-length")
    domain = smallest_domain_size(cost, seq)
    model = cost.model
    options.append(f"use more ranks (a DCP domain of {domain}, a world size of {domain * model.tp * model.pp}, would "
                   f"do at this budget)" if domain is not None else "use more ranks")
    return ", ".join(options[:-1]) + ", or " + options[-1]


def _budget_words(config: DcpConfig, cost: CostModel) -> str:
    """The budget a refusal names: the --dcp-memory-budget-gb given and what its safety margin takes."""
    cluster = cost.cluster
    if config.memory_budget_gb is not None:
        given = f"--dcp-memory-budget-gb {config.memory_budget_gb:g}"
    elif cluster.name != "cpu":
        given = f"the {cluster.mem_bytes_per_gpu / GiB:.4g} GiB read of the device at start (docs/gpu.md)"
    elif config.device_memory_gb is not None:
        given = f"--dcp-device-memory-gb {config.device_memory_gb:g}"
    else:
        given = f"the {cluster.name} preset's {cluster.mem_bytes_per_gpu / GiB:.4g} GiB"
    if config.memory_limit_bytes is not None:
        given += (f" capped to {cluster.mem_bytes_per_gpu / GiB:.4g} GiB by the out-of-memory records beside the "
                  f"checkpoints, which a larger budget does not lift: move {LIMIT_DIR}/ away to plan without them")
    return cluster.budget_words(given)


def check_policy_setting(config: DcpConfig, cost: CostModel) -> None:
    """Before the first step: a --dcp-policy-setting must run a --seq-length document (its CP size divides the
    domain, its recompute is allowed and holds the document's share, its token cap holds it)."""
    from dcp_megatron.config import DcpUsageError

    if config.policy_setting is None:
        return
    try:
        make_plan(config.policy, [(0, config.seq_length)], cost, max_seq_len=config.seq_length,
                  setting=config.policy_setting)
    except ValueError as err:
        raise DcpUsageError(f"--dcp-policy-setting ({config.policy_setting}) cannot run a --seq-length "
                            f"{config.seq_length} document: {err}") from None
