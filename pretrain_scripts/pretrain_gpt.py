"""GPT pretraining on megatron.training, with or without `--dcp` (dcp-megatron's own script).

    torchrun --nproc-per-node 2 pretrain_scripts/pretrain_gpt.py <Megatron flags> [--dcp --dcp-*]

Megatron's loop, flags, datasets, checkpoints, evaluation and logging, unchanged; what this file
supplies is what every megatron.training script supplies: a model provider (megatron-core's
GPTModel with the local or the Transformer Engine layer spec), a datasets provider (Megatron's
GPT / mock datasets through its blended builder), and a forward step whose batches follow the
0.19 packed-sequence contract (`cu_seqlens`, `cu_seqlens_padded`, `max_seqlen`, `local_cp_size`
and the micro-batch's CP group become `PackedSeqParams`), with a per-token loss. The two lines
after the docstring are all DCP needs in a script (the launcher `-m dcp_megatron.launch` does the same
for scripts that lack them).
"""
import dcp_megatron

dcp_megatron.enable()

import sys  # noqa: E402
from functools import partial  # noqa: E402

import torch  # noqa: E402
from megatron.core import mpu  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import (  # noqa: E402
    get_gpt_decoder_block_spec, get_gpt_decoder_layer_specs, get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec, get_gpt_mtp_block_spec)
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer  # noqa: E402
from megatron.core.utils import (  # noqa: E402
    flatten_batch_for_packed_sequences, get_batch_on_this_cp_rank, get_batch_on_this_tp_rank)
from megatron.training import get_args, pretrain, print_rank_0  # noqa: E402
from megatron.training.argument_utils import pretrain_cfg_container_from_args  # noqa: E402
from megatron.training.arguments import core_transformer_config_from_args, parse_and_validate_args  # noqa: E402
from megatron.training.utils import get_blend_and_blend_per_split  # noqa: E402

# The order get_batch returns a batch's fields in.
FIELDS = ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens", "cu_seqlens_padded", "max_seqlen",
          "local_cp_size", "hybrid_cp_group")


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """The GPTModel Megatron-LM's gpt_builders.py builds from the same flags (MoE layers included)."""
    args = get_args()
    config = config if config is not None else core_transformer_config_from_args(args)
    use_te = args.transformer_impl == "transformer_engine"
    if args.num_experts:   # dense and MoE layers as --moe-layer-freq places them, this stage's slice
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization=args.normalization,
                                          qk_l2_norm=args.qk_l2_norm, vp_stage=vp_stage)
    elif use_te:
        spec = get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=config.qk_layernorm, multi_latent_attention=config.multi_latent_attention,
            qk_l2_norm=config.qk_l2_norm, use_te_activation_func=config.use_te_activation_func)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm,
                                        multi_latent_attention=config.multi_latent_attention,
                                        normalization=config.normalization, qk_l2_norm=config.qk_l2_norm)
    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
        mtp_block_spec=_mtp_block_spec(args, config, spec, use_te, vp_stage),
        max_sequence_length=args.max_position_embeddings, pre_process=pre_process, post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy, parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base, rope_scaling=args.use_rope_scaling, vp_stage=vp_stage,
        pg_collection=pg_collection)


def _mtp_block_spec(args, config, spec, use_te: bool, vp_stage):
    """--mtp-num-layers: MTP layers built like the decoder's last layer (an MoE layer when the last one is)."""
    if args.mtp_num_layers is None:
        return None
    if args.num_experts:
        spec = get_gpt_decoder_layer_specs(config, use_transformer_engine=use_te, normalization=args.normalization,
                                           qk_l2_norm=args.qk_l2_norm, vp_stage=vp_stage)[-1]
    return get_gpt_mtp_block_spec(config, spec, use_transformer_engine=use_te, vp_stage=vp_stage)


def datasets_provider(num_samples, vp_stage=None):
    """Megatron's GPT datasets (or its mock dataset) for the train/valid/test sample counts it asks for."""
    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=blend_per_split,
        split=args.split, path_to_cache=args.data_cache_path, tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss, create_attention_mask=args.create_attention_mask_in_dataloader,
        mmap_bin_files=args.mmap_bin_files, inter_document_masking=args.dataloader_inter_document_masking,
        context_parallel_size=args.context_parallel_size, data_parallel_size=args.data_parallel_size)
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0(f"> building {dataset_type.__name__} train/valid/test datasets")

    def built_here():  # the first TP rank reads data; the others receive it by broadcast
        return mpu.get_tensor_model_parallel_rank() == 0

    return BlendedMegatronDatasetBuilder(dataset_type, num_samples, built_here, config).build()


datasets_provider.is_distributed = True


def get_batch(data_iterator):
    """This rank's micro-batch: read on TP rank 0, broadcast over TP, packed, then split over its CP group."""
    args = get_args()
    has_cu_seqlens = args.dataloader_inter_document_masking
    batch = {}
    if mpu.get_tensor_model_parallel_rank() == 0:
        batch = next(data_iterator)
        for key in FIELDS[:-1]:
            if batch.get(key) is not None:
                batch[key] = batch[key].cuda(non_blocking=True)
    batch = get_batch_on_this_tp_rank(
        batch, has_cu_seqlens=has_cu_seqlens, is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(), cp_size=args.context_parallel_size,
        tp_rank=mpu.get_tensor_model_parallel_rank(), micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        # MTP layers sit on the last stage (no --pipeline-model-parallel-layout here): it also needs the tokens
        mtp_on_this_rank=bool(args.mtp_num_layers) and mpu.is_pipeline_last_stage(),
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(), is_pipeline_last_stage=mpu.is_pipeline_last_stage())
    batch = flatten_batch_for_packed_sequences(batch)
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=mpu.get_context_parallel_group(),
                                      use_per_sequence_balancing=has_cu_seqlens)
    return [batch.get(key) for key in FIELDS]


def loss_func(loss_mask, output_tensor):
    """Per-token loss: (sum of the micro-batch's token losses, its token count, report)."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), mask.sum().detach()])}


def forward_step(data_iterator, model):
    tokens, labels, loss_mask, position_ids, cu_seqlens, cu_seqlens_padded, max_seqlen, local_cp_size, cp_group = \
        get_batch(data_iterator)
    packed_seq_params = None
    if cu_seqlens is not None:
        bounds = (cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens).view(-1)
        packed_seq_params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, cu_seqlens_q_padded=bounds,
            cu_seqlens_kv_padded=bounds, max_seqlen_q=int(max_seqlen.max()), max_seqlen_kv=int(max_seqlen.max()),
            local_cp_size=int(local_cp_size.item()) if local_cp_size is not None else None, cp_group=cp_group)
    output = model(tokens, position_ids, None, labels=labels, loss_mask=loss_mask,
                   packed_seq_params=packed_seq_params)
    return output, partial(loss_func, loss_mask)


def refuse_flags_this_script_ignores(args) -> None:
    """Flags Megatron-LM's gpt_builders.py honours and this script does not: exit 2 rather than build another model."""
    unsupported = (("--spec", args.spec), ("--yaml-cfg", getattr(args, "yaml_cfg", None)),
                   ("--experimental-attention-variant", getattr(args, "experimental_attention_variant", None)),
                   ("--heterogeneous-layers-config-path", getattr(args, "heterogeneous_layers_config_path", None)))
    for flag, value in unsupported:
        if value is not None:
            print(f"pretrain_gpt.py: {flag} is not supported by dcp-megatron's script (it would build a different "
                  "model); drop it or run Megatron-LM's pretrain_gpt.py through `python -m dcp_megatron.launch`",
                  file=sys.stderr, flush=True)
            raise SystemExit(2)


if __name__ == "__main__":
    run_args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    refuse_flags_this_script_ignores(run_args)
    pretrain(pretrain_cfg_container_from_args(run_args), datasets_provider, ModelType.encoder_or_decoder,
             forward_step, model_provider=model_provider)
