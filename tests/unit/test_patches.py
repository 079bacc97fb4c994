"""The patch registry and the CPU compat patches built on it."""
from __future__ import annotations

import sys
import types

import pytest

from patches.registry import Patch, PatchRegistry, PatchVersionError

VERSIONS = ">=0.16.1,<0.17"


@pytest.fixture
def fake_upstream(monkeypatch):
    """An upstream module `fakeup.core` with a function, a class and a `from ... import f` alias."""
    core = types.ModuleType("fakeup.core")

    def helper():
        return "original"

    class Thing:
        @staticmethod
        def build():
            return "original build"

    core.helper = helper
    core.Thing = Thing
    user = types.ModuleType("fakeup.user")
    user.helper = helper  # what `from fakeup.core import helper` leaves behind
    renamed = types.ModuleType("fakeup.renamed")
    renamed.other_name = helper
    for name, module in (("fakeup", types.ModuleType("fakeup")), ("fakeup.core", core),
                         ("fakeup.user", user), ("fakeup.renamed", renamed)):
        monkeypatch.setitem(sys.modules, name, module)
    return core, user, renamed


def _replacement():
    return "patched"


def _registry(*patches, version="0.16.1"):
    return PatchRegistry(patches, installed_version=version)


def test_apply_rebinds_target_and_aliases_and_remove_restores_identity(fake_upstream):
    core, user, renamed = fake_upstream
    original_helper, original_build = core.helper, core.Thing.__dict__["build"]
    registry = _registry(
        Patch(target="fakeup.core:helper", replacement=_replacement, reason="test", versions=VERSIONS),
        Patch(target="fakeup.core:Thing.build", replacement=staticmethod(_replacement), reason="test",
              versions=VERSIONS),
    )
    registry.apply()
    assert core.helper is _replacement and user.helper is _replacement
    assert core.Thing.build() == "patched"
    assert renamed.other_name is original_helper  # renamed imports are documented as not searched
    registry.remove()
    assert core.helper is original_helper and user.helper is original_helper
    assert core.Thing.__dict__["build"] is original_build  # the staticmethod object itself is back
    assert core.Thing.build() == "original build"


def test_apply_twice_is_apply_once(fake_upstream):
    core, user, _ = fake_upstream
    original = core.helper
    registry = _registry(Patch(target="fakeup.core:helper", replacement=_replacement, reason="t", versions=VERSIONS))
    registry.apply()
    registry.apply()
    assert registry.applied and core.helper is _replacement
    registry.remove()  # one remove undoes both applies
    assert core.helper is original and user.helper is original
    registry.remove()  # removing again is harmless
    assert core.helper is original


def test_context_manager_and_new_class_attribute(fake_upstream):
    core, _, _ = fake_upstream
    patch = Patch(target="fakeup.core:Thing.extra", replacement=42, reason="adds an attribute", versions=VERSIONS)
    with _registry(patch):
        assert core.Thing.extra == 42
    assert not hasattr(core.Thing, "extra")


def test_rebind_aliases_off_leaves_other_modules_alone(fake_upstream):
    core, user, _ = fake_upstream
    original = core.helper
    with _registry(Patch(target="fakeup.core:helper", replacement=_replacement, reason="t", versions=VERSIONS,
                         rebind_aliases=False)):
        assert core.helper is _replacement and user.helper is original


def test_version_mismatch_is_a_clear_error_and_changes_nothing(fake_upstream):
    core, _, _ = fake_upstream
    original = core.helper
    registry = _registry(
        Patch(target="fakeup.core:helper", replacement=_replacement, reason="t", versions=VERSIONS),
        Patch(target="fakeup.core:Thing.build", replacement=_replacement, reason="t", versions=">=0.18"),
        version="0.17.0",
    )
    with pytest.raises(PatchVersionError) as err:
        registry.apply()
    message = str(err.value)
    assert "0.17.0" in message and "fakeup.core:helper" in message and "fakeup.core:Thing.build" in message
    assert core.helper is original and not registry.applied


def test_a_patch_of_another_distribution_is_checked_against_that_distributions_version(fake_upstream, monkeypatch):
    """A DeepSpeed patch inside a megatron-core registry: its versions refer to the installed deepspeed."""
    core, _, _ = fake_upstream
    installed = {"deepspeed": "0.19.8"}
    monkeypatch.setattr("importlib.metadata.version", lambda name: installed[name])
    ds_patch = Patch(target="fakeup.core:helper", replacement=_replacement, reason="t", versions="==0.19.8",
                     distribution="deepspeed")
    registry = _registry(ds_patch)   # megatron-core "0.16.1": would not satisfy ==0.19.8
    assert "[deepspeed ==0.19.8]" in registry.describe()
    with registry:
        assert core.helper is _replacement
    installed["deepspeed"] = "0.20.0"
    with pytest.raises(PatchVersionError, match=r"installed deepspeed 0.20.0 is not supported by 1 patch\(es\):\n  fakeup.core:helper supports deepspeed==0.19.8"):
        _registry(ds_patch).apply()


def test_failed_apply_rolls_back(fake_upstream):
    core, user, _ = fake_upstream
    original = core.helper
    registry = _registry(
        Patch(target="fakeup.core:helper", replacement=_replacement, reason="t", versions=VERSIONS),
        Patch(target="fakeup.core:missing_function", replacement=_replacement, reason="t", versions=VERSIONS),
    )
    with pytest.raises(AttributeError, match="missing_function"):
        registry.apply()
    assert core.helper is original and user.helper is original


@pytest.mark.parametrize("kwargs, match", [
    (dict(target="no_colon"), "package.module:attr"),
    (dict(target="mod:a..b"), "package.module:attr"),
    (dict(reason="  "), "needs a reason"),
    (dict(versions="not a spec"), "invalid versions"),
])
def test_bad_patch_definitions(kwargs, match):
    fields = dict(target="fakeup.core:helper", replacement=None, reason="r", versions=VERSIONS) | kwargs
    with pytest.raises(ValueError, match=match):
        Patch(**fields)


def test_duplicate_target_rejected():
    patch = Patch(target="fakeup.core:helper", replacement=None, reason="r", versions=VERSIONS)
    with pytest.raises(ValueError, match="registered twice"):
        _registry(patch, patch)


def test_cpu_compat_patches_megatron_and_restores_it():
    pytest.importorskip("megatron.core")
    import torch
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as optimizer_module
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.tensor_parallel.random as tp_random

    from patches.compat import cpu_compat_registry, needs_cpu_compat

    if not needs_cpu_compat():
        pytest.skip("a GPU is present: the CPU shims are not used")
    original_clip = clip_grads.clip_grad_by_total_norm_fp32
    assert optimizer_module.clip_grad_by_total_norm_fp32 is original_clip  # upstream's own alias
    with cpu_compat_registry() as registry:
        assert registry.applied and len(registry.patches) >= 10
        assert schedules.torch is not torch and schedules.torch.zeros([], device="cuda").device.type == "cpu"
        assert schedules.torch.cuda.current_device() == torch.device("cpu")
        assert optimizer_module.clip_grad_by_total_norm_fp32 is clip_grads.clip_grad_by_total_norm_fp32
        assert optimizer_module.clip_grad_by_total_norm_fp32 is not original_clip
        # The "CUDA" RNG tracker works on the CPU generator.
        tp_random.model_parallel_cuda_manual_seed(7, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)
        tracker = tp_random.get_cuda_rng_tracker()
        outside = torch.get_rng_state()
        with tracker.fork():
            inside_draw = torch.rand(3)
        assert torch.equal(torch.get_rng_state(), outside)  # fork restored the caller's stream
        with tracker.fork():
            assert not torch.equal(torch.rand(3), inside_draw)  # the forked stream advanced
    assert schedules.torch is torch
    assert clip_grads.clip_grad_by_total_norm_fp32 is original_clip
    assert optimizer_module.clip_grad_by_total_norm_fp32 is original_clip
