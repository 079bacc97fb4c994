"""The package's layers hold: no import circle, no arrow from a lower layer to a higher one (tools/import_layers.py),
and the DeepSpeed adapter imports nothing of the megatron.training adapter."""
from tests.support.tool_helpers import load_tool

layers = load_tool("import_layers")


def test_no_circle_and_no_arrow_up():
    assert layers.violations() == []


def _violations_of_tree(root, monkeypatch, packages, modules: dict[str, str]) -> list[str]:
    """What the checker finds in a tree of `packages` holding `modules` (path -> source)."""
    for package in packages:
        (root / package).mkdir(parents=True, exist_ok=True)
        (root / package / "__init__.py").write_text("")
    for path, source in modules.items():
        (root / path).write_text(source)
    monkeypatch.setattr(layers, "ROOT", root)
    return layers.violations()


def test_the_checker_sees_a_lazy_arrow_up_and_a_circle(tmp_path, monkeypatch):
    # a planner module importing the runtime inside a function, and two runtime modules importing each other
    packages = ("dcp_megatron", "dcp_megatron/planner", "dcp_megatron/runtime", "patches")
    found = _violations_of_tree(tmp_path, monkeypatch, packages,
                                {"dcp_megatron/planner/bad.py": "def f():\n    from dcp_megatron.runtime import a\n",
                                 "dcp_megatron/runtime/a.py": "from dcp_megatron.runtime import b\n",
                                 "dcp_megatron/runtime/b.py": "import dcp_megatron.runtime.a\n"})
    assert any(v.startswith("dcp_megatron.planner.bad -> dcp_megatron.runtime") for v in found), found
    assert "circle: dcp_megatron.runtime.a -> dcp_megatron.runtime.b" in found, found


def test_deepspeed_adapter_stays_apart_from_the_training_adapter():
    assert ("dcp_megatron.deepspeed", "dcp_megatron.training") in layers.APART


def test_the_product_never_imports_the_test_harness(tmp_path, monkeypatch):
    # a core module reaching into tests/support/ is an arrow up; the harness importing the core is not
    packages = ("dcp_megatron", "dcp_megatron/core", "patches", "tests/support")
    found = _violations_of_tree(tmp_path, monkeypatch, packages,
                                {"dcp_megatron/core/loop.py": "from tests.support.engine import Engine\n",
                                 "tests/support/engine.py": "from dcp_megatron.core import loop\n"})
    assert any(v.startswith("dcp_megatron.core.loop -> tests.support.engine") for v in found), found
    assert not any(v.startswith("tests.support.engine ->") for v in found), found
    assert layers.package_of("tests.support.reference.engine") == "tests.support"


def test_the_cost_model_sits_below_what_builds_plans_and_is_asked_through_its_face(tmp_path, monkeypatch):
    # the cost model reaching up to the layout, a policy past the face, the bound importing a policy: all flagged;
    # the cost model importing the plan format and the layout importing the face: not
    packages = ("dcp_megatron", "dcp_megatron/planner", "dcp_megatron/planner/costmodel", "dcp_megatron/planner/dcp",
                "patches")
    found = _violations_of_tree(tmp_path, monkeypatch, packages, {
        "dcp_megatron/planner/plan.py": "",
        "dcp_megatron/planner/layout.py": "from dcp_megatron.planner.costmodel import CostModel\n",
        "dcp_megatron/planner/costmodel/cost.py": ("from dcp_megatron.planner.plan import Recompute\n"
                                                   "def f():\n    from dcp_megatron.planner import layout\n"),
        "dcp_megatron/planner/dcp/search.py": "from dcp_megatron.planner.costmodel.cost import CostModel\n",
        "dcp_megatron/planner/bounds.py": "from dcp_megatron.planner.dcp import search\n"})
    assert any(v.startswith("dcp_megatron.planner.costmodel.cost -> dcp_megatron.planner.layout")
               for v in found), found
    assert any(v.startswith("dcp_megatron.planner.dcp.search -> dcp_megatron.planner.costmodel.cost (past the")
               for v in found), found
    assert any(v.startswith("dcp_megatron.planner.bounds -> dcp_megatron.planner.dcp") for v in found), found
    assert not any(v.startswith(("dcp_megatron.planner.layout ->",
                                 "dcp_megatron.planner.costmodel.cost -> dcp_megatron.planner.plan"))
                   for v in found), found


def test_the_planner_imports_numpy_and_the_standard_library_alone(tmp_path, monkeypatch):
    packages = ("dcp_megatron", "dcp_megatron/planner", "patches")
    found = _violations_of_tree(tmp_path, monkeypatch, packages, {
        "dcp_megatron/planner/fine.py": "import math\nimport numpy as np\n",
        "dcp_megatron/planner/heavy.py": "def f():\n    import torch.distributed\n"})
    assert any(v.startswith("dcp_megatron.planner.heavy imports torch") for v in found), found
    assert not any(v.startswith("dcp_megatron.planner.fine") for v in found), found
