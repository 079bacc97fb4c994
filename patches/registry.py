"""The patch registry: every change we make to upstream code, recorded, checked and reversible.

A `Patch` names one upstream attribute ("package.module:Attr.path"), the object that replaces
it, why, and the upstream versions it was written against. A `PatchRegistry` applies a set of
patches at one point:

- version-checked first, all or nothing: if the installed distribution (megatron-core by
  default) is outside any patch's specifier, nothing is changed and the error lists every
  unsupported patch;
- idempotent: applying twice is the same as applying once;
- alias-aware: `from x import f` copies `f` into other modules; for a module-level target the
  registry also rebinds every module in `sys.modules` that holds the original object under the
  same name (renamed imports, `from x import f as g`, are not searched);
- reversible: `remove()` puts back every original object (the same objects, by identity),
  aliases included, and deletes attributes that did not exist before. The registry is a
  context manager, so tests can scope patches to a `with` block.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import sys
from dataclasses import dataclass
from typing import Any, Iterable

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

_MISSING = object()  # marks "attribute did not exist before the patch"


class PatchVersionError(RuntimeError):
    """The installed upstream version is not one the patches were written and tested for."""


@dataclass(frozen=True, kw_only=True)
class Patch:
    """One replaced upstream attribute.

    target: "package.module:attr" or "package.module:Class.attr".
    replacement: the object put in its place.
    reason: why upstream behaviour has to change (shown by `describe()`).
    versions: PEP 440 specifier of the upstream versions this patch supports, e.g. ">=0.16,<0.17".
    distribution: the upstream distribution `versions` refers to; None: the registry's (megatron-core
        by default). A DeepSpeed patch in a megatron-core registry names "deepspeed".
    rebind_aliases: also rebind `from module import attr` copies (module-level targets only).
        Turn it off when the original is shared widely, e.g. a patched module's `torch` binding.
    """

    target: str
    replacement: Any
    reason: str
    versions: str
    distribution: str | None = None
    rebind_aliases: bool = True

    def __post_init__(self) -> None:
        module_name, sep, attr_path = self.target.partition(":")
        if not sep or not module_name or not attr_path or any(not p for p in attr_path.split(".")):
            raise ValueError(f"patch target must look like 'package.module:attr.path', got {self.target!r}")
        if not self.reason.strip():
            raise ValueError(f"patch {self.target!r} needs a reason")
        try:
            SpecifierSet(self.versions)
        except InvalidSpecifier as err:
            raise ValueError(f"patch {self.target!r} has invalid versions {self.versions!r}: {err}") from None

    @property
    def module_name(self) -> str:
        return self.target.partition(":")[0]

    @property
    def attr_path(self) -> tuple[str, ...]:
        return tuple(self.target.partition(":")[2].split("."))

    def supports(self, version: str) -> bool:
        return Version(version) in SpecifierSet(self.versions)


@dataclass
class _Binding:
    """One slot we overwrote: owner.name held `original` (or was missing)."""

    owner: Any
    name: str
    original: Any

    def restore(self) -> None:
        if self.original is _MISSING:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.original)


class PatchRegistry:
    """Holds patches; applies and removes them together (see the module docstring)."""

    def __init__(
        self,
        patches: Iterable[Patch] = (),
        *,
        distribution: str = "megatron-core",
        installed_version: str | None = None,
    ) -> None:
        self.distribution = distribution
        self._installed_version = installed_version   # of `distribution`; others are read when checked
        self._patches: list[Patch] = []
        self._bindings: list[_Binding] = []
        self._applied = False
        for patch in patches:
            self.register(patch)

    @property
    def patches(self) -> tuple[Patch, ...]:
        return tuple(self._patches)

    @property
    def applied(self) -> bool:
        return self._applied

    @property
    def installed_version(self) -> str:
        if self._installed_version is None:
            self._installed_version = importlib.metadata.version(self.distribution)
        return self._installed_version

    def register(self, patch: Patch) -> Patch:
        if self._applied:
            raise RuntimeError(f"cannot register {patch.target!r}: the registry is already applied")
        if any(p.target == patch.target for p in self._patches):
            raise ValueError(f"patch target {patch.target!r} is registered twice")
        self._patches.append(patch)
        return patch

    def distribution_of(self, patch: Patch) -> str:
        return patch.distribution or self.distribution

    def _version_of(self, distribution: str) -> str:
        if distribution == self.distribution:
            return self.installed_version
        return importlib.metadata.version(distribution)

    def describe(self) -> str:
        return "\n".join(f"{p.target}  [{self.distribution_of(p)} {p.versions}]  {p.reason}" for p in self._patches)

    def check_versions(self) -> None:
        unsupported: dict[tuple[str, str], list[Patch]] = {}   # (distribution, installed version) -> patches
        for patch in self._patches:
            distribution = self.distribution_of(patch)
            version = self._version_of(distribution)
            if not patch.supports(version):
                unsupported.setdefault((distribution, version), []).append(patch)
        if unsupported:
            heading = "; ".join(f"installed {distribution} {version} is not supported by {len(patches)} patch(es)"
                                for (distribution, version), patches in unsupported.items())
            lines = "\n".join(f"  {p.target} supports {distribution}{p.versions}"
                              for (distribution, _), patches in unsupported.items() for p in patches)
            raise PatchVersionError(f"{heading}:\n{lines}\nInstall a supported version or port these patches.")

    def apply(self) -> "PatchRegistry":
        if self._applied:
            return self
        self.check_versions()
        try:
            for patch in self._patches:
                self._apply_one(patch)
        except BaseException:
            self._restore_all()
            raise
        self._applied = True
        return self

    def remove(self) -> None:
        if not self._applied:
            return
        self._restore_all()
        self._applied = False

    def __enter__(self) -> "PatchRegistry":
        return self.apply()

    def __exit__(self, *exc_info: object) -> None:
        self.remove()

    def _restore_all(self) -> None:
        # Reverse order: a slot patched twice gets its first original back last.
        while self._bindings:
            self._bindings.pop().restore()

    def _apply_one(self, patch: Patch) -> None:
        owner: Any = importlib.import_module(patch.module_name)
        *owner_path, name = patch.attr_path
        for part in owner_path:
            owner = getattr(owner, part)
        # Read the raw slot for classes so staticmethod/classmethod wrappers come back as they were.
        if isinstance(owner, type):
            original = vars(owner).get(name, _MISSING)
        else:
            original = getattr(owner, name, _MISSING)
        if original is _MISSING and not owner_path:
            raise AttributeError(f"patch target {patch.target!r} does not exist upstream")
        self._bind(owner, name, patch.replacement, original)
        if patch.rebind_aliases and not owner_path and original is not _MISSING:
            for module in list(sys.modules.values()):
                if module is None or module is owner:
                    continue
                if getattr(module, "__dict__", {}).get(name, _MISSING) is original:
                    self._bind(module, name, patch.replacement, original)

    def _bind(self, owner: Any, name: str, replacement: Any, original: Any) -> None:
        self._bindings.append(_Binding(owner, name, original))
        setattr(owner, name, replacement)
