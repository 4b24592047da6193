"""The house's rules, checked on the source: sizes (no file over about 800 lines, no class over
600), private torch API only in gradlens/compat.py, the size thresholds only in
gradlens/core/limits.py, no class told by its name string. (No import cycle: tests/test_imports.py.)"""

from __future__ import annotations

import ast
import pathlib
import re

import gradlens
from gradlens.core import limits

ROOT = pathlib.Path(gradlens.__file__).parent
SOURCES = sorted(ROOT.rglob("*.py"))


def _rel(p: pathlib.Path) -> str:
    return str(p.relative_to(ROOT.parent))


def test_no_file_over_800_lines_and_no_class_over_600():
    files = [(_rel(p), n) for p in SOURCES if (n := len(p.read_text().splitlines())) > 800]
    classes = []
    for p in SOURCES:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 600:
                classes.append((f"{_rel(p)}:{node.name}", node.end_lineno - node.lineno + 1))
    assert not files, f"files over 800 lines: {files}; split them by concept"
    assert not classes, f"classes over 600 lines: {classes}; split them by concept"


#: what private torch API looks like in source: underscore attributes of torch's own objects
PRIVATE = re.compile(
    r"nn\.modules\.\w+\._[A-Za-z]|\._(parameters|buffers|modules|forward_pre_hooks|forward_hooks|backward_hooks"
    r"|forward_pre_hooks_with_kwargs|load_from_state_dict|check_input_dim|get_fsdp_state|values|indices"
    r"|register_load_state_dict_pre_hook|version|base|cdata)\b"
    r"|torch\._(?!_)[a-z]|torch\.utils\._[a-z]|torch\.distributed\._[a-z]|\._C\b"
)


def _code_lines(p: pathlib.Path):
    """(line number, line) of the code outside docstrings and comments."""
    src = p.read_text()
    doc = set()
    for node in ast.walk(ast.parse(src)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(
                getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
            doc.update(range(body[0].lineno, body[0].end_lineno + 1))
    for i, line in enumerate(src.splitlines(), 1):
        code = line.split("#", 1)[0]
        if i not in doc and code.strip():
            yield i, code


def test_private_torch_api_only_in_compat():
    found = [f"{_rel(p)}:{i}: {line.strip()}" for p in SOURCES if p.name != "compat.py"
             for i, line in _code_lines(p) if PRIVATE.search(line)]
    assert not found, "private torch API outside gradlens/compat.py (add an entry there, with a guard test):\n" + "\n".join(found)


def test_the_pattern_sees_private_uses():
    for line in ("isinstance(m, nn.modules.loss._Loss)", "mod._parameters[a] = p", "g._values()",
                 "mod._get_fsdp_state()", "x = torch._foreach_norm(t)", "m._forward_pre_hooks.items()"):
        assert PRIVATE.search(line), line
    for line in ("self._counter.close()", "torch.__version__", "lens._window", "F.linear(x, w)"):
        assert not PRIVATE.search(line), line


def test_size_thresholds_only_in_limits():
    """A module-level ``NAME = 1 << k`` (a size threshold) stands in core/limits.py alone; the
    modules that use one import it from there."""
    shift = re.compile(r"^_?[A-Z][A-Z0-9_]* *(: *[^=]+)?= *1 *<< *\d+")
    found = [f"{_rel(p)}:{i}: {line.strip()}" for p in SOURCES if p != pathlib.Path(limits.__file__)
             for i, line in _code_lines(p) if shift.match(line)]
    assert not found, "size thresholds outside gradlens/core/limits.py:\n" + "\n".join(found)
    assert all(isinstance(getattr(limits, n), int) and getattr(limits, n) > 0 for n in limits.__all__)


def test_no_class_told_by_its_name():
    name_test = re.compile(r"__name__\s*(==|!=|in)\s*|type\([^)]*\)\.__name__\s*\)?\s*(==|!=|in)\b")
    found = [f"{_rel(p)}:{i}: {line.strip()}" for p in SOURCES if p.name != "__main__.py"
             for i, line in _code_lines(p) if name_test.search(line) and '__name__ == "__main__"' not in line]
    assert not found, "classes told by a name string (use isinstance or a declared attribute):\n" + "\n".join(found)
