"""GPT pretraining on the DeepSpeed engine, with or without `--dcp` (dcp-megatron's DeepSpeed script).

    deepspeed --num_gpus 8 pretrain_scripts/pretrain_gpt_deepspeed.py --deepspeed-config ds.json \
        <Megatron's model, data and batch flags> --train-iters 1000 [--dcp --dcp-* | "dcp" block in ds.json]
    torchrun --nproc-per-node 2 pretrain_scripts/pretrain_gpt_deepspeed.py ...   (the same; on CPU: gloo)

One flag set for both engines: the flags, data and model are Megatron's (its parser and `validate_args`,
tokenizer, GPT datasets and sampler: each step trains the `--global-batch-size` samples Megatron's loop would);
DeepSpeed owns the JSON config (ZeRO stage, precision, clipping, optimizer and scheduler), `deepspeed.initialize`
and its checkpoints. What this file supplies is what a user writes: the model provider (megatron-core's GPTModel
from Megatron's flags, TP = PP = 1) and the forward/loss (a per-token loss over a packed micro-batch); the
trainer (set-up, loop, logging, timeouts, evaluation, checkpoints) is dcp_megatron/deepspeed/trainer.py.

With `--dcp` each global batch is planned (CP size per document, micro-batches per rank, recompute per
micro-batch); without it the same documents run Megatron's static layout. Both train each batch's per-token
loss, so loss traces of any layout and world size agree. Without a GPU the CPU flags are defaulted.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_model(args: argparse.Namespace, *, has_gpu: bool, bf16: bool):
    """megatron-core's GPTModel from Megatron's model flags for TP = PP = 1, initialised from --seed (the same
    weights on every rank and world size; Megatron's model-parallel state must be set up first, see
    setup_training). Precision is the DeepSpeed JSON's; the local spec (our packed CP attention) on CPU."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                          get_gpt_layer_with_transformer_engine_spec)
    from megatron.training.arguments import core_transformer_config_from_args

    torch.manual_seed(args.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    config = core_transformer_config_from_args(args)
    config.bf16, config.fp16 = bf16, False
    config.params_dtype = torch.bfloat16 if bf16 else torch.float32
    # DeepSpeed reduces gradients itself: Megatron's fused accumulation into main_grad has no buffer here.
    config.gradient_accumulation_fusion = False
    if args.transformer_impl == "transformer_engine":
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=args.qk_layernorm)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm, normalization=args.normalization)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                     max_sequence_length=args.max_position_embeddings, parallel_output=True,
                     share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                     position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                     rotary_base=args.rotary_base)
    return model, config


def forward_loss(engine, batch: dict):
    """(sum of the micro-batch's masked token losses, its valid token count): the per-token loss."""
    from dcp_megatron.core.microbatch_facts import packed_seq_params

    losses = engine(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                    packed_seq_params=packed_seq_params(batch))
    mask = batch["loss_mask"].view(-1).float()
    return torch.sum(losses.view(-1).float() * mask), int(mask.sum())


def main(argv=None) -> int:
    """The script as a command: 0 when trained, 2 (one line on stderr, nothing trained) for a usage error."""
    import dcp_megatron

    return dcp_megatron.train_deepspeed(argv, model_provider=build_model, forward_loss=forward_loss)


if __name__ == "__main__":
    sys.exit(main())
