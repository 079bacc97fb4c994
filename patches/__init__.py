"""Every change dcp-megatron makes to upstream code, and the sets entry points apply.

Nothing is applied on import. The CPU shims apply only when no GPU is present; compat.py collects them: one
table for the upstream modules whose only change is the CPU view of torch (cpu_torch.py), and the
`CPU_PATCHES` of the others. Every other upstream module we change has one file here listing its `Patch`
entries (see registry.py). Their DCP patches (`dcp_patches()`) join the CPU shims in two sets (megatron_set.py,
deepspeed_set.py), which the entry points ask for by name (sets.py): `dcp_megatron.enable()` and the launcher
`patch_set("megatron")`, the DeepSpeed script `patch_set("deepspeed", timeout=...)`. Patches call into
dcp_megatron's adapters; the adapters never import patches. One change is not a `Patch`: torch_compile.py, a context
the sets (and `train_deepspeed`) import megatron-core in, under which its import-time `torch.compile` calls return
the function as written when TORCH_COMPILE_DISABLE=1 (no compiler imported by a rank).
"""

# The megatron-core release these patches were written against and run on (widen only to versions that were run).
MEGATRON_CORE_VERSIONS = "==0.19.2"

# The DeepSpeed release the DeepSpeed patches (deepspeed_*.py) were written against and run on.
DEEPSPEED_VERSIONS = "==0.19.8"
