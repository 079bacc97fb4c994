"""The patch sets the entry points apply, by name."""
from __future__ import annotations

PATCH_SETS = ("megatron", "deepspeed")


def patch_set(name: str, **options):
    """The `PatchRegistry` of one set, not applied: "megatron" (megatron.training runs: megatron_set.py) or
    "deepspeed" (a DeepSpeed run of a megatron-core model, `timeout=` the job's collective timeout:
    deepspeed_set.py). `installed_version=` overrides the version the patches check against (tests)."""
    from patches.torch_compile import eager_compile

    if name == "megatron":
        from patches.megatron_set import megatron_patch_registry

        with eager_compile():   # the sets' first megatron-core import (TORCH_COMPILE_DISABLE=1: no compiler import)
            return megatron_patch_registry(**options)
    if name == "deepspeed":
        from patches.deepspeed_set import deepspeed_patch_registry

        with eager_compile():
            return deepspeed_patch_registry(**options)
    raise ValueError(f"no patch set {name!r}; the sets are {', '.join(PATCH_SETS)}")
