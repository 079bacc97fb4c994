"""Every change dcp-megatron makes to upstream code, one file per upstream module.

Each file lists `Patch` entries (see registry.py); nothing is applied on import. The CPU
shims (`CPU_PATCHES`) are collected by `dcp_megatron.megatron.compat` and applied only when no GPU
is present; the DCP patches (`dcp_patches()`: transformer attention's RoPE group, TE's CP stream)
join them in `dcp_megatron.megatron.patch_set.megatron_patch_registry()`, which pretrain_gpt.py
applies once at start-up.
"""

# The megatron-core release these patches were written against and run on (widen only to versions that were run).
MEGATRON_CORE_VERSIONS = "==0.19.2"

# The DeepSpeed release the DeepSpeed patches (deepspeed_*.py) were written against and run on.
DEEPSPEED_VERSIONS = "==0.19.8"
