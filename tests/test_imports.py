"""gradlens' own imports: no cycle among its modules (function-local imports included, since they
only hide one), and every module imports first in a fresh interpreter. (That ``import gradlens``
stays free of matplotlib is checked in tests/test_plot.py.)"""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import gradlens

ROOT = pathlib.Path(gradlens.__file__).parent


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The dotted names an import statement in ``module`` names (relative imports resolved)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            pkg = module.split(".") if is_package else module.split(".")[:-1]
            pkg = pkg[: len(pkg) - node.level + 1]
            base = ".".join(pkg + ([base] if base else []))
        return [base] + [f"{base}.{a.name}" for a in node.names]
    return []


def import_graph() -> dict[str, set[str]]:
    """module -> gradlens modules whose import it runs (the packages on a dotted path count: a
    submodule's import runs its package's ``__init__`` first, unless the importer is inside it)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            for name in _imported(node, mod, path.name == "__init__.py"):
                parts = name.split(".")
                for k in range(2, len(parts) + 1):
                    target = ".".join(parts[:k])
                    if target in mods and target != mod and not mod.startswith(target + "."):
                        graph[mod].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_graph_sees_function_local_imports():
    graph = import_graph()
    assert "gradlens.instruments" in graph["gradlens.lens.record"]  # base's package __init__ runs
    assert "gradlens.output.log_reader" in graph["gradlens.output.plot"]  # imported inside a function


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, f"import cycles among gradlens modules (function-local imports included): {found}"


# modules whose import needs a framework this environment may lack
_NEEDS = {"gradlens.integrations.lightning": ("lightning", "pytorch_lightning"), "gradlens.integrations.transformers": ("transformers",)}

_SCRIPT = """
import importlib, importlib.util, json, sys
mods, needs = json.loads(sys.argv[1]), json.loads(sys.argv[2])
failed = {}
for m in mods:
    for k in [k for k in sys.modules if k == "gradlens" or k.startswith("gradlens.")]:
        del sys.modules[k]  # every module first, as in a fresh interpreter (torch stays loaded)
    try:
        importlib.import_module(m)
    except ImportError as err:
        absent = m in needs and all(importlib.util.find_spec(f) is None for f in needs[m])
        if not absent:
            failed[m] = repr(err)
    except Exception as err:
        failed[m] = repr(err)
print(json.dumps(failed))
"""


def test_every_module_imports_first():
    # each module is imported first (a cycle fails the module whose import enters it)
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(sorted(_modules())), json.dumps(_NEEDS)],
        capture_output=True, text=True, timeout=300, cwd=ROOT.parent,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    failed = json.loads(out.stdout.strip().splitlines()[-1])
    assert failed == {}, f"modules that fail to import first: {failed}"
