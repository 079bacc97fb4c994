"""Every change dcp-megatron makes to upstream code, one file per upstream module, and the sets entry points apply.

Each upstream-module file lists `Patch` entries (see registry.py); nothing is applied on import. The CPU shims
(`CPU_PATCHES`, collected by compat.py) apply only when no GPU is present; the CPU view of torch they use is
cpu_torch.py. The DCP patches (`dcp_patches()`) join them in two sets (megatron_set.py, deepspeed_set.py), which the entry points ask for
by name (sets.py): `dcp_megatron.enable()` and the launcher `patch_set("megatron")`, the DeepSpeed script
`patch_set("deepspeed", timeout=...)`. Patches call into dcp_megatron's adapters; the adapters never import
patches.
"""

# The megatron-core release these patches were written against and run on (widen only to versions that were run).
MEGATRON_CORE_VERSIONS = "==0.19.2"

# The DeepSpeed release the DeepSpeed patches (deepspeed_*.py) were written against and run on.
DEEPSPEED_VERSIONS = "==0.19.8"
