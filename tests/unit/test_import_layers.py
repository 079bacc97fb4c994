"""The package's layers hold: no import circle, no arrow from a lower layer to a higher one (tools/import_layers.py),
and the DeepSpeed adapter imports nothing of the megatron.training adapter."""
from tests.support.tool_helpers import load_tool

layers = load_tool("import_layers")


def test_no_circle_and_no_arrow_up():
    assert layers.violations() == []


def test_the_checker_sees_a_lazy_arrow_up_and_a_circle(tmp_path, monkeypatch):
    # a planner module importing the runtime inside a function, and two runtime modules importing each other
    root = tmp_path
    for package in ("dcp_megatron", "dcp_megatron/planner", "dcp_megatron/runtime", "patches"):
        (root / package).mkdir(parents=True, exist_ok=True)
        (root / package / "__init__.py").write_text("")
    (root / "dcp_megatron/planner/bad.py").write_text("def f():\n    from dcp_megatron.runtime import a\n")
    (root / "dcp_megatron/runtime/a.py").write_text("from dcp_megatron.runtime import b\n")
    (root / "dcp_megatron/runtime/b.py").write_text("import dcp_megatron.runtime.a\n")
    monkeypatch.setattr(layers, "ROOT", root)
    found = layers.violations()
    assert any(v.startswith("dcp_megatron.planner.bad -> dcp_megatron.runtime") for v in found), found
    assert "circle: dcp_megatron.runtime.a -> dcp_megatron.runtime.b" in found, found


def test_deepspeed_adapter_stays_apart_from_the_training_adapter():
    assert ("dcp_megatron.deepspeed", "dcp_megatron.training") in layers.APART


def test_the_product_never_imports_the_test_harness(tmp_path, monkeypatch):
    # a core module reaching into tests/support/ is an arrow up; the harness importing the core is not
    root = tmp_path
    for package in ("dcp_megatron", "dcp_megatron/core", "patches", "tests/support"):
        (root / package).mkdir(parents=True, exist_ok=True)
        (root / package / "__init__.py").write_text("")
    (root / "dcp_megatron/core/loop.py").write_text("from tests.support.engine import Engine\n")
    (root / "tests/support/engine.py").write_text("from dcp_megatron.core import loop\n")
    monkeypatch.setattr(layers, "ROOT", root)
    found = layers.violations()
    assert any(v.startswith("dcp_megatron.core.loop -> tests.support.engine") for v in found), found
    assert not any(v.startswith("tests.support.engine ->") for v in found), found
    assert layers.package_of("tests.support.reference.engine") == "tests.support"
