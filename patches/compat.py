"""CPU compatibility for megatron-core: all CPU shims, in one place, active only without a GPU.

Most shims change one thing in an upstream module that hard-codes CUDA: its global `torch`, bound to the
CPU view (cpu_torch.py), seen by that module only. Where that is all we change in a module, the shim is a
row of `CPU_SHIM_TABLE`. A module we change in other ways too keeps its shims beside those changes, in
its own file: `CPU_PATCHES`, or `cpu_patches()` where they wrap upstream functions at apply time. This
module collects both into one `PatchRegistry`. The caller owns the registry: apply it once before
building the model and keep it (or use it as a context manager in tests).
"""
from __future__ import annotations

import importlib

import torch

from patches import MEGATRON_CORE_VERSIONS
from patches.cpu_torch import cpu_torch_patch
from patches.registry import Patch, PatchRegistry

# (upstream module, what is replaced, the upstream versions it was run on, why). "torch": the module's
# global `torch` becomes the CPU view.
CPU_SHIM_TABLE = (
    ("megatron.core.datasets.data_schedule", "torch", MEGATRON_CORE_VERSIONS,
     "Megatron's hybrid-CP data wrapper exchanges samples through buffers on torch.cuda.current_device()."),
    ("megatron.core.dist_checkpointing.exchange_utils", "torch", MEGATRON_CORE_VERSIONS,
     "checkpoint shard exchange allocates its receive buffers with device='cuda'."),
    ("megatron.core.dist_checkpointing.strategies.async_utils", "torch", MEGATRON_CORE_VERSIONS,
     "async checkpoint workers check liveness with tensors on torch.cuda.current_device() and synchronize CUDA."),
    ("megatron.core.dist_checkpointing.strategies.fully_parallel", "torch", MEGATRON_CORE_VERSIONS,
     "the fully parallel save/load wrapper calls torch.cuda.synchronize()."),
    ("megatron.core.dist_checkpointing.strategies.state_dict_saver", "torch", MEGATRON_CORE_VERSIONS,
     "the torch_dist save finalisation all-reduces its status on torch.cuda.current_device()."),
    ("megatron.core.distributed.param_and_grad_buffer", "torch", MEGATRON_CORE_VERSIONS,
     "DDP's contiguous grad (and param) buffers are allocated on torch.cuda.current_device()."),
    ("megatron.core.models.common.embeddings.rope_utils", "torch", MEGATRON_CORE_VERSIONS,
     "get_pos_emb_on_this_cp_rank (context parallelism) builds its chunk indices on the CUDA device."),
    ("megatron.core.models.common.embeddings.rotary_pos_embedding", "torch", MEGATRON_CORE_VERSIONS,
     "RotaryEmbedding moves inv_freq to torch.cuda.current_device() on its first forward."),
    ("megatron.core.optimizer.optimizer", "torch", MEGATRON_CORE_VERSIONS,
     "FP32Optimizer and the chained optimizer create their loss-scale tensors with device='cuda'."),
    ("megatron.core.pipeline_parallel.hybrid_cp_schedule", "torch", MEGATRON_CORE_VERSIONS,
     "Megatron's hybrid-CP schedule counts samples per group in tensors on CUDA."),
    ("megatron.core.pipeline_parallel.p2p_communication", "torch", MEGATRON_CORE_VERSIONS,
     "p2p receive buffers live on torch.cuda.current_device() and batch_isend_irecv is followed by "
     "torch.cuda.synchronize()."),
    ("megatron.core.pipeline_parallel.schedules", "torch", MEGATRON_CORE_VERSIONS,
     "the schedules create total_num_tokens with device='cuda'."),
    ("megatron.core.rerun_state_machine", "torch", MEGATRON_CORE_VERSIONS,
     "saves and restores torch.cuda RNG state around every step (the CPU generator on a CPU run)."),
    ("megatron.core.tensor_parallel.data", "torch", MEGATRON_CORE_VERSIONS,
     "broadcast_data (tensor-parallel batch broadcast) allocates its buffers on torch.cuda.current_device()."),
    ("megatron.core.tensor_parallel.mappings", "torch", MEGATRON_CORE_VERSIONS,
     "sequence-parallel all-gather / reduce-scatter outputs are allocated on torch.cuda.current_device()."),
    ("megatron.core.timers", "torch", MEGATRON_CORE_VERSIONS,
     "Timers allocate their all-gather buffers on torch.cuda.current_device() and synchronize CUDA."),
    ("megatron.core.transformer.moe.experts", "torch", MEGATRON_CORE_VERSIONS,
     "expert MLPs place weights and token-count tensors on `torch.cuda.current_device()`."),
    ("megatron.core.transformer.moe.moe_layer", "torch", MEGATRON_CORE_VERSIONS,
     "the MoE layer's optional streams and events (`torch.cuda.Stream`, `torch.cuda.current_stream`) for "
     "overlapped shared experts and delayed weight gradients."),
    ("megatron.core.transformer.moe.token_dispatcher", "torch", MEGATRON_CORE_VERSIONS,
     "the alltoall dispatcher creates a `torch.cuda.Stream()` at construction and moves token counts with "
     "`.to(torch.device('cuda'))`/`.cuda()`; MoE on CPU fails at model build."),
    ("megatron.core.transformer.utils", "torch", MEGATRON_CORE_VERSIONS,
     "the default causal attention mask is built with device='cuda'."),
    ("megatron.training.models.dist_utils", "torch", MEGATRON_CORE_VERSIONS,
     "places the model with module.cuda(torch.cuda.current_device()) and wraps DDP set-up in a side CUDA stream."),
    ("megatron.training.utils.common_utils", "torch", MEGATRON_CORE_VERSIONS,
     "model-parallel reductions of the update flag, loss and grad-norm helpers allocate on "
     "torch.cuda.current_device()."),
    ("megatron.training.utils.utils", "torch", MEGATRON_CORE_VERSIONS,
     "reporting helpers (memory, loss averaging across data-parallel ranks) allocate on CUDA."),
)

# patches/ modules (one per upstream module) whose CPU_PATCHES sit beside their other changes.
_CPU_PATCH_MODULES = (
    "core_utils",
    "optimizer_clip_grads",
    "tensor_parallel_layers",
    "tensor_parallel_random",
    "training_training",
    "torch_cuda_methods",
    "models_backends",
    "training_checkpointing",
    "core_dist_checkpointing_filesystem_async",
    "training_arguments",
    "transformer_moe_router",
    "transformer_moe_moe_utils",
    "transformer_multi_token_prediction",
)

# patches/ modules whose shims are built at apply time (`cpu_patches()`: they wrap upstream functions).
_CPU_PATCH_BUILDERS = (
    "training_initialize",
    "optimizer_distrib_optimizer",
    "transformer_torch_norm",
)


def needs_cpu_compat() -> bool:
    """True when megatron-core has to run without CUDA."""
    return not torch.cuda.is_available()


def _table_patch(module: str, replaced: str, versions: str, reason: str) -> Patch:
    assert replaced == "torch", f"{module}: the table binds the CPU view as `torch`, not {replaced!r}"
    return cpu_torch_patch(module, reason, versions)


def cpu_compat_patches() -> tuple[Patch, ...]:
    table = tuple(_table_patch(*row) for row in CPU_SHIM_TABLE)
    static = tuple(patch for name in _CPU_PATCH_MODULES
                   for patch in importlib.import_module(f"patches.{name}").CPU_PATCHES)
    built = tuple(patch for name in _CPU_PATCH_BUILDERS
                  for patch in importlib.import_module(f"patches.{name}").cpu_patches())
    return table + static + built


def cpu_compat_registry(*, installed_version: str | None = None) -> PatchRegistry:
    """The CPU shims as one registry (empty on a machine with a GPU: nothing to change there)."""
    from patches.torch_compile import eager_compile

    with eager_compile():   # a shims-only script's first megatron-core import
        patches = cpu_compat_patches() if needs_cpu_compat() else ()
    return PatchRegistry(patches, installed_version=installed_version)
