#!/usr/bin/env python3
"""The project's import graph, checked against its layers: no circle, no arrow from a lower layer to a higher one.

    python tools/import_layers.py          # prints every violation (exit 1), or the layers and "ok"

Every import counts, also those inside functions (a lazy import is still an arrow). Layers, bottom up:
config < planner < runtime, data < core, checks < training, deepspeed < patches < entry points < the test
harness (tests/support/: the reference engine and the helpers tests and tools share; it imports the product,
the product never imports it).

Inside the planner (the standard library, numpy and, for the optional MILP reference, highspy: nothing else), tiers
bottom up: the plan format (plan.py, padding.py) < the cost model (costmodel/) < what the policies build with
(layout, timeline, validate, the bound, ...: every planner module not named in PLANNER_TIERS) < the policies
(policies.py, dcp/, baselines/). A planner module imports its own tier and lower ones, and outside costmodel/ it asks
the cost model through its face (`dcp_megatron.planner.costmodel`, its __init__) only, never an inner module.
"""
from __future__ import annotations

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
# module prefix -> layer; a module may import its own layer's package and any lower layer
LAYERS = {
    "dcp_megatron.config": 0,
    "dcp_megatron.planner": 1,
    "dcp_megatron.runtime": 2,
    "dcp_megatron.data": 2,
    "dcp_megatron.core": 3,
    "dcp_megatron.flags": 3,
    "dcp_megatron.training": 4,
    "dcp_megatron.deepspeed": 4,
    "patches": 5,
    # entry points: ask patches for a set by name, run a script
    "dcp_megatron": 6, "dcp_megatron.launch": 6, "dcp_megatron.profile": 6,
    "dcp_megatron.simulate": 3, "dcp_megatron.simulate_report": 2, "dcp_megatron.plotting": 2,
    "tests.support": 7,
}
# same-layer packages that must not see each other (the two adapters; the shared checks above the seams)
APART = {("dcp_megatron.deepspeed", "dcp_megatron.training"), ("dcp_megatron.training", "dcp_megatron.deepspeed"),
         ("dcp_megatron.core", "dcp_megatron.flags"), ("dcp_megatron.runtime", "dcp_megatron.data"),
         ("dcp_megatron.data", "dcp_megatron.runtime")}

# Inside the planner (module docstring): module prefix -> tier, the longest prefix wins; unnamed modules are tier 2
PLANNER_TIERS = {"dcp_megatron.planner.plan": 0, "dcp_megatron.planner.padding": 0,   # the plan format
                 "dcp_megatron.planner.costmodel": 1,                                   # the cost model
                 "dcp_megatron.planner": 2,                                             # what builds plans
                 "dcp_megatron.planner.policies": 3, "dcp_megatron.planner.dcp": 3,     # the policies
                 "dcp_megatron.planner.baselines": 3}
COST_MODEL = "dcp_megatron.planner.costmodel"     # its face: the package itself; its inner modules are its own
PLANNER_THIRD_PARTY = ("numpy", "highspy")        # beyond the standard library (highspy: milp_reference, optional)


def package_of(module: str) -> str:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len, default=None)
    return best


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for base in ("dcp_megatron", "patches", "tests/support"):
        for path in (ROOT / base).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def imports_of(path: pathlib.Path, known: set[str]) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


def violations() -> list[str]:
    found = modules()
    graph = {m: imports_of(p, set(found)) - {m} for m, p in found.items()}
    bad = []
    for module, targets in sorted(graph.items()):
        src = package_of(module)
        for target in sorted(targets):
            dst = package_of(target)
            if src is None or dst is None or src == dst:
                continue
            if target in ("dcp_megatron",):   # the package root (its docstring and version), not enable()
                continue
            if LAYERS[dst] > LAYERS[src] or (LAYERS[dst] == LAYERS[src]) or (src, dst) in APART:
                bad.append(f"{module} -> {target} ({src} layer {LAYERS[src]} imports {dst} layer {LAYERS[dst]})")
    bad += planner_violations(graph, found)
    bad += [f"circle: {' -> '.join(c)}" for c in circles(graph)]
    return bad


def planner_tier(module: str) -> int | None:
    best = max((p for p in PLANNER_TIERS if module == p or module.startswith(p + ".")), key=len, default=None)
    return None if best is None else PLANNER_TIERS[best]


def planner_violations(graph: dict[str, set[str]], found: dict[str, pathlib.Path]) -> list[str]:
    """The planner's own rules (module docstring): tiers, the cost model's face, numpy only."""
    bad = []
    for module, targets in sorted(graph.items()):
        src = planner_tier(module)
        if src is None:
            continue
        inside = module == COST_MODEL or module.startswith(COST_MODEL + ".")
        for target in sorted(targets):
            dst = planner_tier(target)
            if dst is None:
                continue
            if dst > src:
                bad.append(f"{module} -> {target} (planner tier {src} imports tier {dst})")
            elif target.startswith(COST_MODEL + ".") and not inside:
                bad.append(f"{module} -> {target} (past the cost model's face: import it from {COST_MODEL})")
        for name in sorted(third_party_of(found[module])):
            bad.append(f"{module} imports {name} (the planner imports the standard library and "
                       f"{', '.join(PLANNER_THIRD_PARTY)} only)")
    return bad


def third_party_of(path: pathlib.Path) -> set[str]:
    """Top-level names of what `path` imports from outside the standard library and the project."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            top = name.partition(".")[0]
            if top not in sys.stdlib_module_names and top not in ("dcp_megatron",) + PLANNER_THIRD_PARTY:
                out.add(top)
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each as a list."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


if __name__ == "__main__":
    problems = violations()
    print("\n".join(problems) if problems else "ok: no circle, no arrow up")
    sys.exit(1 if problems else 0)
