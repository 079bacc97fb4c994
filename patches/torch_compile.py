"""`torch.compile` while megatron-core is first imported, under `TORCH_COMPILE_DISABLE=1`: the function as written.

megatron-core compiles at import: megatron.core.jit binds `jit_fuser = torch.compile` for its fusions, and MoE's
router and token dispatcher decorate with `@torch.compile`. Each call imports torch's compiler (dynamo, inductor,
sympy, jinja templates): ~2.3 of ~6.5 CPU s of a rank's imports (docs/benchmarks.md, "The test suite"), also when
`TORCH_COMPILE_DISABLE=1` makes every compiled function run as written. With that variable set, `eager_compile()`
(a context around the code that imports megatron-core first: patches/sets.py, compat.py) binds `torch.compile` to
`_as_written`, which returns the function itself, and puts torch's back on exit; megatron.core.jit's fuser is then
upstream's own no-op (`disable_jit_fuser`). What runs is what torch runs with compiling disabled. Without the
variable, or once megatron-core is imported, nothing changes. Not a `Patch`: the registry replaces attributes after
their module ran, too late for decorators.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator

import torch


def compile_disabled() -> bool:
    """torch's own switch, read as torch._dynamo.config reads it (without importing dynamo)."""
    return os.environ.get("TORCH_COMPILE_DISABLE", "0") == "1"


def _as_written(model=None, **_options):
    """`torch.compile(fn)`, `torch.compile(**options)(fn)` and `@torch.compile`: `fn` itself."""
    return model if model is not None else (lambda fn: fn)


@contextlib.contextmanager
def eager_compile() -> Iterator[None]:
    """Within the block (TORCH_COMPILE_DISABLE=1, megatron-core not yet imported) `torch.compile` is `_as_written`."""
    if not compile_disabled() or "megatron.core" in sys.modules or torch.compile is _as_written:
        yield
        return
    compile_ = torch.compile
    torch.compile = _as_written
    try:
        yield
    finally:
        torch.compile = compile_
        jit = sys.modules.get("megatron.core.jit")
        if jit is not None and jit.jit_fuser is _as_written:
            jit.disable_jit_fuser()   # upstream's own no-op decorator for what imports it later
