"""Every Megatron flag the DeepSpeed script parses is honoured or refused by name, never dropped.

The script parses megatron.training's whole parser (over 800 flags) so one command line moves between the engines,
but it runs only part of megatron.training: the model from megatron-core's TransformerConfig, Megatron's data,
tokenizer, batch, learning-rate schedule, evaluation and run flags. A flag whose parsed value differs from what
the parser gives without it (so it was given, whatever its spelling) is honoured when its destination is in
`HONOURED` (or a field of megatron-core's TransformerConfig, which `core_transformer_config_from_args` hands to
the model); every other one is refused with one line naming it and, where a Megatron argument group says why,
the reason (`GROUP_REASONS`). The specific refusals of arguments.py (TP/PP/CP sizes, the JSON's settings,
Megatron's writers) run first and say what to use instead.

tests/unit/test_deepspeed_flag_coverage.py walks the parser: every flag is honoured or refused, and a Megatron
release that adds flags fails it until they are classified here.
"""
from __future__ import annotations

import argparse
import dataclasses

from dcp_megatron.config import DcpUsageError

# Destinations (beyond TransformerConfig's fields and the --dcp* group) the DeepSpeed path reads.
HONOURED = frozenset({
    # model shape (build_model, core_transformer_config_from_args) and its CPU defaults
    "group_query_attention", "max_position_embeddings", "position_embedding_type", "make_vocab_size_divisible_by",
    "openai_gelu", "squared_relu", "swiglu", "quick_geglu", "untie_embeddings_and_output_weights",
    "use_rotary_position_embeddings", "bias_gelu_fusion", "bias_swiglu_fusion", "no_persist_layer_norm",
    "init_method_xavier_uniform", "te_rng_tracker", "num_experts", "seed", "recompute_activations",
    # optimizer, clipping, precision: written into the DeepSpeed JSON (megatron_flags.py)
    "optimizer", "lr", "adam_beta1", "adam_beta2", "adam_eps", "weight_decay", "clip_grad", "sgd_momentum",
    # Megatron's schedule on the engine (lr_schedule.py)
    "lr_decay_style", "lr_decay_iters", "lr_warmup_iters", "lr_warmup_fraction", "lr_warmup_init", "min_lr",
    "lr_wsd_decay_style", "lr_wsd_decay_iters", "start_weight_decay", "end_weight_decay", "weight_decay_incr_style",
    "override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler",
    # batch and run
    "micro_batch_size", "global_batch_size", "train_iters", "exit_interval", "log_interval", "save", "save_interval",
    "load", "distributed_backend", "distributed_timeout_minutes", "local_rank",
    # evaluation (evaluation.py)
    "eval_iters", "eval_interval", "eval_global_batch_size", "eval_micro_batch_size",
    # data (samples.py: Megatron's GPT datasets)
    "data_path", "split", "train_data_path", "valid_data_path", "test_data_path", "data_args_path",
    "per_split_data_args_path", "data_cache_path", "mmap_bin_files", "mock_data", "seq_length",
    "reset_position_ids", "reset_attention_mask", "dataloader_inter_document_masking", "eod_mask_loss",
    # tokenizer (megatron-core's build_tokenizer)
    "vocab_size", "vocab_file", "merge_file", "vocab_extra_ids", "tokenizer_type", "tokenizer_model",
    "metadata_path", "special_tokens", "tiktoken_pattern", "tiktoken_num_special_tokens",
    "tokenizer_sentencepiece_legacy", "tokenizer_sentencepiece_ignore_extra_whitespaces", "tokenizer_hf_no_use_fast",
    "tokenizer_hf_no_include_special_tokens", "trust_remote_code", "null_tokenizer_eod_id", "null_tokenizer_pad_id",
    "chat_template",
    # the script's own
    "deepspeed_config", "override_optimizer_config",
})

# Why a Megatron argument group's flags do not run here (the rest of a group not listed: not run by this script).
GROUP_REASONS = {
    "checkpointing": "DeepSpeed writes and loads the checkpoints (--save, --load, --save-interval)",
    "mixed precision": 'the DeepSpeed JSON owns precision and loss scaling ("bf16", "fp16")',
    "distributed init": "DeepSpeed's engine owns the data-parallel group and its gradient reduction (the JSON)",
    "profiling": "Megatron's profiler hooks are in its training loop, which this script does not run",
    "logging": "the script logs Megatron's iteration line; the JSON's monitor blocks write the scalars",
    "regularization": "only --weight-decay, --clip-grad, --adam-* and --sgd-momentum map onto the DeepSpeed JSON",
    "learning rate and weight decay": "Megatron's scheduler runs here with the iteration-counted flags only",
    "validation": "evaluation runs with --eval-iters, --eval-interval and the eval batch flags only",
}
# Flags of a group the script runs in part, refused with what to do instead.
SPECIFIC = {
    "ckpt_step": "{flag} {value}: the DeepSpeed script resumes from the checkpoint the 'latest' file in --load names; "
                 "write that step's tag into it (or --load a directory holding only that checkpoint)",
}
_NOT_RUN = ("is a megatron.training flag the DeepSpeed script does not run ({reason}); drop it, or run "
            "pretrain_scripts/pretrain_gpt.py (the Megatron path)")


def honoured_destinations() -> frozenset[str]:
    """HONOURED, megatron-core's TransformerConfig fields (MLA's included) and the --dcp* group."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from dcp_megatron.flags.dcp_flags import add_dcp_arguments

    dcp_group = {action.dest for action in add_dcp_arguments(argparse.ArgumentParser())._actions} - {"help"}
    return HONOURED | dcp_group | {field.name for field in dataclasses.fields(MLATransformerConfig)}


def given_destinations(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """Destinations whose parsed value differs from the parser's own value without the flag."""
    baseline = vars(parser.parse_args(["--deepspeed-config", args.deepspeed_config]))
    return [dest for dest, value in baseline.items() if getattr(args, dest, value) != value]


def refuse_unhonoured_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> None:
    """DcpUsageError naming the first given flag the script neither honours nor refuses elsewhere."""
    honoured = honoured_destinations()
    groups = {action.dest: group.title for group in parser._action_groups for action in group._group_actions}
    for dest in given_destinations(parser, args):
        if dest in honoured:
            continue
        if dest in SPECIFIC:
            raise DcpUsageError(SPECIFIC[dest].format(flag=flag_name(parser, dest, argv), value=getattr(args, dest)))
        raise DcpUsageError(f"{flag_name(parser, dest, argv)} "
                            + _NOT_RUN.format(reason=GROUP_REASONS.get(groups.get(dest), "not wired to the engine")))


def flag_name(parser: argparse.ArgumentParser, dest: str, argv: list[str]) -> str:
    """The spelling of `dest`'s flag on the command line (else its first option string)."""
    options = [option for action in parser._actions if action.dest == dest for option in action.option_strings]
    written = [option for option in options if any(arg == option or arg.startswith(option + "=") for arg in argv)]
    return (written or options or [f"--{dest.replace('_', '-')}"])[0]
