"""docs/design.md's "Where the code is" stays true: its folder order is the import order (a module
imports only from its own folder and the folders below it, function-level imports included),
every module of gradlens/ is in its tree, and every gradlens path the page names exists."""

from __future__ import annotations

import ast
import pathlib
import re

import gradlens

ROOT = pathlib.Path(gradlens.__file__).parent
PAGE = ROOT.parent / "docs" / "design.md"


def _section() -> str:
    text = PAGE.read_text()
    return text[text.index("## Where the code is"):]


def _order() -> list[str]:
    """The folders as the page lists them, bottom up."""
    head = _section().split("\n\n")[1]
    line = head[head.index("bottom up:"): head.index(". A module")]
    return re.findall(r"`(\w+)`", line)


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, gradlens module) of every import in ``path``, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            if node.module == "gradlens":  # from gradlens import kernels as K
                out += [(node.lineno, f"gradlens.{a.name}") for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
    return [(i, m) for i, m in out if m.startswith("gradlens.")]


def test_the_order_names_every_folder():
    layers = {p.stem for p in ROOT.iterdir() if (p.is_dir() and (p / "__init__.py").exists())
              or (p.suffix == ".py" and not p.name.startswith("__"))}
    assert sorted(_order()) == sorted(layers)


def test_a_lower_folder_never_imports_an_upper_one():
    rank = {name: i for i, name in enumerate(_order())}
    up = []
    for path in sorted(ROOT.rglob("*.py")):
        me = path.relative_to(ROOT).parts[0].removesuffix(".py")
        if me not in rank:
            continue
        for line, module in _imports(path):
            other = module.split(".")[1]
            if other in rank and rank[other] > rank[me]:
                up.append(f"{path.relative_to(ROOT.parent)}:{line} ({me}) imports {module} ({other})")
    assert not up, "upward imports (docs/design.md, Where the code is):\n" + "\n".join(up)


def test_the_tree_lists_every_module():
    tree = _section()
    missing = [str(p.relative_to(ROOT.parent)) for p in sorted(ROOT.rglob("*.py"))
               if not p.name.startswith("__") and not re.search(rf"\b{re.escape(p.name)}", tree)]
    assert not missing, f"modules missing from docs/design.md's tree: {missing}"


def test_every_path_the_page_names_exists():
    named = set(re.findall(r"\bgradlens/[\w/]+\.py\b", PAGE.read_text()))
    assert named, "the page names no path"
    gone = sorted(p for p in named if not (ROOT.parent / p).exists())
    assert not gone, f"docs/design.md names files that do not exist: {gone}"
