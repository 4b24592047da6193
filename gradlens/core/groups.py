"""Parameter groups: which layer a per-group statistic belongs to (``Lens(..., groups=...)``).

A grouping maps every tracked parameter (qualified name, as in ``model.named_parameters()``;
a shared parameter appears once, under its first name) to exactly one group:

- ``"param"``: one group per parameter, named by the parameter;
- ``"module"``: one group per module that owns parameters directly, named by the module's
  qualified name (``"(model)"`` for parameters of the root module itself);
- ``{name: [patterns]}``: ``fnmatch`` patterns over parameter names; a parameter joins the
  first group (in the dict's order) with a matching pattern; unmatched ones form ``"other"``.

Groups are disjoint, so sums over parameters (``sum_grad_squared``, ``batch_l2``, the squared
norm of the window gradient) add up over groups to the record's totals.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ROOT_GROUP", "OTHER_GROUP", "check_groups", "group_params"]

#: the group name of parameters owned by the root module under ``groups="module"``
ROOT_GROUP = "(model)"
#: the group of parameters no pattern matched under ``groups={name: [patterns]}``
OTHER_GROUP = "other"


def check_groups(groups: Any) -> Any:
    """``groups`` checked (``None``, ``"param"``, ``"module"`` or a dict group name -> list of
    ``fnmatch`` patterns); a dict is returned with its pattern lists as tuples. Raises
    ``TypeError`` / ``ValueError`` naming the value and a form that works."""
    if groups is None or groups in ("param", "module"):
        return groups
    example = "groups={'attn': ['*.attn.*'], 'mlp': ['*.mlp.*']}"
    if isinstance(groups, str):
        raise ValueError(f"Lens(groups={groups!r}): use None, 'param', 'module' or a dict, e.g. {example}")
    if not isinstance(groups, Mapping) or not groups:
        raise TypeError(
            f"Lens(groups=...) takes None, 'param', 'module' or a non-empty dict group name -> list "
            f"of fnmatch patterns, got {groups!r}; e.g. {example}"
        )
    out = {}
    for name, patterns in groups.items():
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(
                f"Lens(groups=...): group names must be non-empty str without '/', got {name!r}; e.g. {example}"
            )
        if name == OTHER_GROUP:
            raise ValueError(
                f"Lens(groups=...): {OTHER_GROUP!r} is the group of unmatched parameters; name "
                f"yours differently, e.g. {example}"
            )
        if isinstance(patterns, str):
            patterns = [patterns]
        if not isinstance(patterns, Sequence) or not patterns or not all(
            isinstance(p, str) and p for p in patterns
        ):
            raise TypeError(
                f"Lens(groups=...): group {name!r} needs a list of fnmatch patterns (str), got "
                f"{patterns!r}; e.g. {example}"
            )
        out[name] = tuple(patterns)
    return out


def group_params(groups: Any, names: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """Group name -> its parameter names, for the tracked parameters ``names`` under the checked
    ``groups`` spec (``{}`` for ``None``). Groups come in the order of their first parameter
    (a dict spec: in the dict's order, ``"other"`` last); empty groups are left out."""
    if groups is None:
        return {}
    if groups == "param":
        of = {q: q for q in names}
    elif groups == "module":
        of = {q: q.rpartition(".")[0] or ROOT_GROUP for q in names}
    else:
        of = {}
        for q in names:
            of[q] = next(
                (g for g, patterns in groups.items() if any(fnmatch.fnmatchcase(q, p) for p in patterns)),
                OTHER_GROUP,
            )
    out: dict[str, list[str]] = {}
    if isinstance(groups, Mapping):
        for g in (*groups, OTHER_GROUP):
            out[g] = []
    for q, g in of.items():
        out.setdefault(g, []).append(q)
    return {g: tuple(qs) for g, qs in out.items() if qs}
