"""Checks of saved state: :class:`StateDictError` and the validators with which every
``load_state_dict`` of gradlens (each instrument's, the Lens') checks a state before it changes
anything. A leaf module (torch only), so that instruments and the Lens' checkpoint format
(:mod:`gradlens.lens.state`) both import it at module top."""

from __future__ import annotations

import math
from typing import Any, Callable

from torch import Tensor

# (annotations name the instruments' and the Lens' classes without importing them: no cycle)

__all__ = [
    "StateDictError", "Check", "COUNT", "FLOAT", "RANGE", "TENSORS", "check_state", "label", "optional",
    "is_int", "is_count", "is_float", "is_range", "is_tensor_dict",
]

class StateDictError(ValueError, TypeError):
    """A state dict that does not fit what loads it (another Lens, another instrument, a
    damaged or foreign dict). Both a ``ValueError`` and a ``TypeError``: catch either."""


# =============================================================================== instruments
def label(inst: "Instrument") -> str:
    """``"GradHist1d (record key 'grad_hist_1d')"``: how messages name an instrument (a monitor
    without a record key, e.g. NoiseScaleDDP, by its class)."""
    key = getattr(inst, "key", None)
    return type(inst).__name__ if key is None else f"{type(inst).__name__} (record key {key!r})"


#: a check of one state value: (predicate, what the value must be, in words)
Check = tuple[Callable[[Any], bool], str]


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_count(v: Any) -> bool:
    return is_int(v) and v >= 0


def is_float(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def is_range(v: Any) -> bool:
    """A pair ``[lo, hi]`` of finite numbers with lo < hi."""
    return isinstance(v, (list, tuple)) and len(v) == 2 and all(is_float(x) for x in v) and v[0] < v[1]


def is_tensor_dict(v: Any) -> bool:
    """A dict name -> tensor."""
    return isinstance(v, dict) and all(isinstance(k, str) and isinstance(t, Tensor) for k, t in v.items())


def optional(check: Check) -> Check:
    """``check`` or None."""
    ok, what = check
    return (lambda v: v is None or ok(v)), f"None or {what}"


COUNT: Check = (is_count, "an int >= 0")
FLOAT: Check = (is_float, "a finite number")
RANGE: Check = (is_range, "a pair [lo, hi] of finite numbers with lo < hi")
TENSORS: Check = (is_tensor_dict, "a dict parameter name -> tensor")


def _plain(v: Any) -> Any:
    """Tuples as lists (a saved config compares with the instrument's own)."""
    return [_plain(x) for x in v] if isinstance(v, (list, tuple)) else v


def check_state(inst: "Instrument", state: Any, checks: dict[str, Check] | None = None,
                same: dict[str, Any] | None = None) -> None:
    """Validate ``state`` for ``inst.load_state_dict`` before anything is set.

    Args:
        checks: key -> (predicate, description) of what the instrument keeps between windows.
        same: key -> this instrument's own value of a setting that the saved state must share
            (bins, seeds, modes: what gives the kept state its meaning).

    Raises:
        StateDictError: ``state`` is not a dict, lacks or adds keys, a value fails its check, or
            a setting differs; the message names the instrument, the key and the fix.
    """
    checks, same = checks or {}, same or {}
    if not isinstance(state, dict):
        raise StateDictError(
            f"{label(inst)}.load_state_dict(state=...) takes the dict from its state_dict(), got "
            f"{type(state).__name__}"
        )
    want = set(checks) | set(same)
    missing, extra = sorted(want - set(state)), sorted(set(state) - want)
    if missing or extra:
        parts = ([f"lacks key(s) {missing}"] if missing else []) + (
            [f"has key(s) {extra} that {type(inst).__name__} does not keep"] if extra else []
        )
        raise StateDictError(
            f"the state of {label(inst)} {' and '.join(parts)}; it was saved by another instrument "
            f"or another gradlens: build the Lens with the instruments of the saved run"
        )
    for key, mine in same.items():
        if _plain(state[key]) != _plain(mine):
            raise StateDictError(
                f"{label(inst)} was saved with {key}={state[key]!r}, this one has {key}={mine!r}; "
                f"build it as in the saved run: {type(inst).__name__}(..., {key}={state[key]!r})"
            )
    for key, (ok, what) in checks.items():
        if not ok(state[key]):
            value = state[key]
            shown = f"a {type(value).__name__}" if isinstance(value, (Tensor, dict)) else repr(value)
            raise StateDictError(
                f"the state of {label(inst)} has {key}={shown}, which must be {what}; the "
                "checkpoint is damaged or was not written by this instrument's state_dict()"
            )
