"""patches/torch_compile.py: under TORCH_COMPILE_DISABLE=1 megatron-core's import-time torch.compile calls return the
function as written, so no rank imports torch's compiler for them; torch.compile is torch's again afterwards."""
from __future__ import annotations

import subprocess
import sys
import types

import torch

from patches import torch_compile
from tests.support.megatron_runs import REPO, run_env


def _first_import(monkeypatch, *, disabled: str):
    """Run eager_compile() as if megatron-core were not imported yet; a stand-in megatron.core.jit binds its fuser."""
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", disabled)
    for name in [name for name in sys.modules if name == "megatron.core" or name.startswith("megatron.core.")]:
        monkeypatch.delitem(sys.modules, name)
    jit = types.SimpleNamespace(jit_fuser=None, disabled=False)
    jit.disable_jit_fuser = lambda: setattr(jit, "disabled", True)
    compile_before = torch.compile
    with torch_compile.eager_compile():
        monkeypatch.setitem(sys.modules, "megatron.core", types.ModuleType("megatron.core"))
        monkeypatch.setitem(sys.modules, "megatron.core.jit", jit)
        jit.jit_fuser = torch.compile
        decorated = torch.compile(lambda x: x + 1)
        made = torch.compile(mode="default")(len)
    assert torch.compile is compile_before
    return jit, decorated, made


def test_disabled_compile_returns_the_function_during_the_first_import_and_restores_torch(monkeypatch):
    jit, decorated, made = _first_import(monkeypatch, disabled="1")
    assert made is len and decorated(1) == 2 and type(decorated).__name__ == "function"
    assert jit.disabled   # megatron.core.jit's fuser: upstream's own no-op from then on


def test_without_the_variable_torch_compile_is_untouched(monkeypatch):
    jit, decorated, made = _first_import(monkeypatch, disabled="0")
    assert jit.jit_fuser is torch.compile and not jit.disabled and made is not len


def test_a_rank_importing_megatron_core_through_the_patch_sets_imports_no_compiler():
    """What a launch's rank does first (CPU shims, then the megatron set): torch's dynamo/inductor stay unimported."""
    code = ("import sys\nfrom patches.compat import cpu_compat_registry\nfrom patches.sets import patch_set\n"
            "cpu_compat_registry(); patch_set('megatron')\n"
            "import megatron.core.fusions.fused_bias_geglu as g, torch\n"
            "compiler = {m.split('.')[1] for m in sys.modules if m.startswith(('torch._dynamo', 'torch._inductor'))}\n"
            "print(sorted(compiler), type(g.geglu).__name__, torch.compile.__module__)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**run_env(), "TORCH_COMPILE_DISABLE": "1"},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[-2] == "[] function torch", result.stdout[-2000:]
