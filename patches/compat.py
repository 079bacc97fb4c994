"""CPU compatibility for megatron-core: all CPU shims, in one place, active only without a GPU.

The shims themselves live in patches/ (one file per upstream module, each entry saying why);
this module only collects them into one `PatchRegistry`. The caller owns the registry: apply
it once before building the model and keep it (or use it as a context manager in tests).
"""
from __future__ import annotations

import importlib

import torch

from patches.registry import Patch, PatchRegistry

# patches/ modules (one per upstream megatron-core module) whose CPU_PATCHES make up the shims.
_CPU_PATCH_MODULES = (
    "core_utils",
    "distributed_param_and_grad_buffer",
    "models_rotary_pos_embedding",
    "optimizer_clip_grads",
    "optimizer_optimizer",
    "pipeline_parallel_p2p_communication",
    "pipeline_parallel_schedules",
    "tensor_parallel_layers",
    "tensor_parallel_mappings",
    "tensor_parallel_random",
    "transformer_utils",
    "training_training",
    "torch_cuda_methods",
    "core_timers",
    "training_models_dist_utils",
    "core_rerun_state_machine",
    "models_backends",
    "training_utils_common_utils",
    "training_utils_utils",
    "training_checkpointing",
    "tensor_parallel_data",
    "core_dist_checkpointing_filesystem_async",
    "core_dist_checkpointing_state_dict_saver",
    "core_dist_checkpointing_exchange_utils",
    "core_dist_checkpointing_fully_parallel",
    "core_dist_checkpointing_async_utils",
    "core_datasets_data_schedule",
    "pipeline_parallel_hybrid_cp_schedule",
    "training_arguments",
    "models_rope_utils",
    "transformer_moe_token_dispatcher",
    "transformer_moe_router",
    "transformer_moe_moe_layer",
    "transformer_moe_moe_utils",
    "transformer_moe_experts",
)


def needs_cpu_compat() -> bool:
    """True when megatron-core has to run without CUDA."""
    return not torch.cuda.is_available()


# patches/ modules whose shims are built at apply time (`cpu_patches()`: they wrap upstream functions).
_CPU_PATCH_BUILDERS = (
    "training_initialize",
    "optimizer_distrib_optimizer",
    "transformer_torch_norm",
)


def cpu_compat_patches() -> tuple[Patch, ...]:
    static = tuple(patch for name in _CPU_PATCH_MODULES
                   for patch in importlib.import_module(f"patches.{name}").CPU_PATCHES)
    built = tuple(patch for name in _CPU_PATCH_BUILDERS
                  for patch in importlib.import_module(f"patches.{name}").cpu_patches())
    return static + built


def cpu_compat_registry(*, installed_version: str | None = None) -> PatchRegistry:
    """The CPU shims as one registry (empty on a machine with a GPU: nothing to change there)."""
    patches = cpu_compat_patches() if needs_cpu_compat() else ()
    return PatchRegistry(patches, installed_version=installed_version)
