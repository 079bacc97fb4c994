"""Every patch the launcher applies to megatron-core / megatron.training, as one registry.

- CPU shims (compat.py: its table and the modules' CPU_PATCHES), only on a machine without a GPU;
- arguments: the --dcp* flags in Megatron's parser and their start-up checks;
- training loop: under --dcp, the planned schedule (`get_forward_backward_func`);
- checkpointing: under --dcp, a checksum manifest after each save (checked at start-up before a resume); every
  run: a failed save (a full disk) ends in one line naming the cause and file, with no partial iteration left;
- core utils: DCP micro-batches keep their shard and carry their CP group through `get_batch`;
- GPT model: a middle pipeline stage's packed params get the micro-batch's CP size and group;
- transformer attention: a packed micro-batch's RoPE uses its CP group, and its selective recompute holds in replays;
- multi-latent attention: the same for MLA, whose forward also refuses a CP size in the params and cuts RoPE's table;
- multi-token prediction: its shift runs per document on the micro-batch's CP group, its loss is weighted per document;
- transformer layer + MoE router: an MoE router's balancing losses are per document of the micro-batch;
- tensor-parallel layers: every run, an expert's output projection on a TP group of one skips the no-op
  all-reduce whose view output the expert MLP's in-place bias add trips on (EP 1 MoE with biases);
- activation checkpoints: every run, a checkpointed MLP's bias Parameter comes back as a copy (its replay
  recursed until the rank died; megatron's checkpoint, and TE's on GPU);
- Transformer Engine (GPU with TE only): a CP stream for dynamic CP groups;
- fine-grained activation offload: under --dcp on GPU, every step its own offload warm-up (per-micro-batch sets).
Without --dcp the DCP entries pass everything through to Megatron unchanged.
"""
from __future__ import annotations

from patches.compat import cpu_compat_patches, needs_cpu_compat
from patches import (core_dist_checkpointing_filesystem_async, core_utils, extensions_transformer_engine,
                     models_gpt_gpt_model, pipeline_parallel_fine_grained_activation_offload, tensor_parallel_layers,
                     tensor_parallel_random, training_arguments, training_checkpointing, training_initialize, training_training,
                     transformer_attention,
                     transformer_moe_router, transformer_multi_latent_attention, transformer_multi_token_prediction,
                     transformer_transformer_layer)
from patches.registry import PatchRegistry


def megatron_patch_registry(*, installed_version: str | None = None) -> PatchRegistry:
    from dcp_megatron.config import RunSpecSlot

    specs = RunSpecSlot()   # the run spec validate_args builds, for the loop's patches
    patches = cpu_compat_patches() if needs_cpu_compat() else ()
    patches += (training_arguments.dcp_patches(specs) + training_training.dcp_patches(specs) + core_utils.dcp_patches()
                + transformer_attention.dcp_patches() + transformer_multi_latent_attention.dcp_patches()
                + transformer_multi_token_prediction.dcp_patches()
                + extensions_transformer_engine.dcp_patches()
                + training_checkpointing.dcp_patches() + core_dist_checkpointing_filesystem_async.dcp_patches()
                + transformer_transformer_layer.dcp_patches() + transformer_moe_router.dcp_patches()
                + models_gpt_gpt_model.dcp_patches() + tensor_parallel_layers.dcp_patches()
                + tensor_parallel_random.dcp_patches()
                + pipeline_parallel_fine_grained_activation_offload.dcp_patches()
                + training_initialize.dcp_patches())
    return PatchRegistry(patches, installed_version=installed_version)
