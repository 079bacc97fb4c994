"""Build the pieces pretrain_gpt.py trains: TransformerConfig, GPTModel, DDP, optimizer, LR schedule.

Each function takes the parsed flags it needs and returns one piece; the script calls them in
order, so the recipe reads top to bottom there and the details live here.
"""
from __future__ import annotations

import argparse

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_block import get_num_layers_to_build

from dcp_megatron.megatron.init_weights import init_weights_by_name
from dcp_megatron.megatron.layer_spec import gpt_block_spec


def padded_vocab_size(vocab_size: int, *, divisible_by: int, tp_size: int) -> int:
    """Megatron pads the vocabulary so each TP rank holds an equal, aligned slice."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def transformer_config(args: argparse.Namespace) -> TransformerConfig:
    recompute = {}
    if args.recompute_granularity == "full":
        recompute = dict(recompute_granularity="full", recompute_method="block",
                         recompute_num_layers=args.recompute_num_layers)
    elif args.recompute_granularity == "selective":
        # Only core attention: selective MLP recompute with biases never terminates on 0.16.1 and
        # layernorm recompute needs Transformer Engine (DESIGN.md section 7a).
        recompute = dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        ffn_hidden_size=args.ffn_hidden_size,
        normalization=args.normalization,
        gated_linear_unit=args.swiglu,
        activation_func=torch.nn.functional.silu if args.swiglu else torch.nn.functional.gelu,
        add_bias_linear=not args.disable_bias_linear,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        # Megatron's static CP stays 1: the runtime runs each micro-batch on its planned CP group.
        context_parallel_size=1,
        sequence_parallel=args.sequence_parallel,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        bf16=args.bf16,
        fp8=args.fp8_format,
        use_cpu_initialization=True,
        # Megatron's own draw is overwritten by init_weights_by_name, but it is also where the
        # tensor-parallel partition attributes get set, so it stays on.
        perform_initialization=True,
        # Micro-batches hold different numbers of tokens; without this p2p receives into
        # wrongly sized buffers. The dense model then needs the all-to-all dispatcher setting
        # to pass TransformerConfig's validation (DESIGN.md section 7a).
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",
        calculate_per_token_loss=True,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        **recompute,
    )


def build_model(args: argparse.Namespace, config: TransformerConfig) -> GPTModel:
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    num_layers_on_stage = get_num_layers_to_build(config, vp_stage=None, pp_rank=pp_rank)
    model = GPTModel(
        config=config,
        transformer_layer_spec=gpt_block_spec(config, num_layers_on_stage, attention_backend=args.attention_backend),
        vocab_size=padded_vocab_size(args.vocab_size, divisible_by=args.make_vocab_size_divisible_by,
                                     tp_size=args.tensor_model_parallel_size),
        max_sequence_length=args.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type="rope",
        rotary_base=args.rotary_base,
    )
    init_weights_by_name(model, config, seed=args.seed, tp_size=args.tensor_model_parallel_size,
                         tp_rank=parallel_state.get_tensor_model_parallel_rank())
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())  # built on CPU (use_cpu_initialization) for layout-free init
    if args.bf16:
        # Casts inputs/outputs at the model boundary, as Megatron's mixed-precision training does.
        from megatron.core.transformer.module import Float16Module
        return Float16Module(config, model)
    return model


def wrap_ddp(model: GPTModel, config: TransformerConfig) -> DistributedDataParallel:
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    ddp_model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    # The schedules defer the DP gradient all-reduce to the last micro-batch through these.
    config.no_sync_func = ddp_model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return ddp_model


def build_optimizer(args: argparse.Namespace, ddp_model: DistributedDataParallel):
    opt_config = OptimizerConfig(
        optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, clip_grad=args.clip_grad,
        bf16=args.bf16, fp16=False, params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        use_distributed_optimizer=False,
    )
    return get_megatron_optimizer(opt_config, [ddp_model])


def build_lr_schedule(args: argparse.Namespace, optimizer) -> OptimizerParamScheduler:
    """Linear warmup to --lr, then cosine decay to --min-lr by --lr-decay-iters."""
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters, lr_decay_steps=args.lr_decay_iters, lr_decay_style="cosine",
        start_wd=args.weight_decay, end_wd=args.weight_decay, wd_incr_steps=args.train_iters,
        wd_incr_style="constant",
    )
