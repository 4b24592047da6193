"""The window lifecycle: the counters a component keeps about its windows.

A *window* is one real optimizer update made of K micro-steps, micro-step k of B_k samples
(docs/design.md). Whatever a component accumulates over a window (the Lens its statistics,
:class:`~gradlens.GradientAccumulateOptimizer` the gradients, ``AccumBatchNorm`` the pooled
moments, :class:`~gradlens.instruments.noise.NoiseScaleMonitor` the norms), the window's life is
the same: micro-steps are noted with their sample count, and the window ends in one of three
ways:

* ``close(updated=True)``: a real update; counted in ``updates``;
* ``close(updated=False)``: a *skipped* window, ended without an update (a GradScaler found
  inf/nan; for the Lens also an ``opt.reset()``, which the optimizer itself does not count);
  counted in ``skipped``, its contents are dropped;
* ``reset()``: the partial window is dropped and nothing is counted.

:class:`WindowCounter` holds these counters as one explicit state, as optax's ``MultiSteps``
keeps ``mini_step`` and ``gradient_step`` in ``MultiStepsState``; what a component accumulates
(tensors, sums) stays its own. A leaf module (``gradlens.core.state_checks`` only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from gradlens.core.state_checks import StateDictError, is_count, is_float

__all__ = ["WindowCounter", "counter_property"]

#: counter -> (check, what it must be, in words)
_CHECKS = {
    "micro_steps": (is_count, "an int >= 0"),
    "samples": (lambda v: is_float(v) and v >= 0, "a finite number >= 0"),
    "updates": (is_count, "an int >= 0"),
    "skipped": (is_count, "an int >= 0"),
    "has_updated": (lambda v: isinstance(v, bool), "True or False"),
}


@dataclass
class WindowCounter:
    """The counters of a window lifecycle (module docstring).

    Attributes:
        micro_steps: micro-steps noted in the open window.
        samples: their summed sample count (the ``samples`` given to :meth:`note_micro`: B_k, a
            token count, a micro-step weight), a float.
        updates: windows closed with a real update so far.
        skipped: windows ended without an update so far.
        has_updated: whether the last window to end was closed with an update.
    """

    micro_steps: int = 0
    samples: float = 0.0
    updates: int = 0
    skipped: int = 0
    has_updated: bool = False

    @property
    def is_open(self) -> bool:
        """Whether micro-steps have been noted since the window opened."""
        return self.micro_steps > 0

    def note_micro(self, samples: float = 1.0) -> None:
        """One more micro-step of ``samples`` samples in the open window."""
        self.micro_steps += 1
        self.samples += samples

    def clear(self) -> None:
        """Empty the open window (micro-steps and samples to 0); nothing else changes."""
        self.micro_steps = 0
        self.samples = 0.0

    def close(self, updated: bool) -> None:
        """End the window: ``updated`` True counts a real update, False a skipped window; the
        next window starts empty."""
        if updated:
            self.updates += 1
        else:
            self.skipped += 1
        self.has_updated = updated
        self.clear()

    def reset(self) -> None:
        """Drop the partial window without counting it (``has_updated`` becomes False)."""
        self.clear()
        self.has_updated = False

    # ---------------------------------------------------------------------- checkpoints
    def state_dict(self, names: Mapping[str, str] | None = None) -> dict[str, Any]:
        """The counters as plain data: ``{key: value}`` for each ``counter -> key`` of ``names``
        (default: all five under their own names), in the order of ``names``."""
        names = names if names is not None else {f: f for f in _CHECKS}
        return {key: getattr(self, field) for field, key in names.items()}

    def load_state_dict(self, state: Mapping[str, Any], names: Mapping[str, str] | None = None, *,
                        where: str = "state_dict", defaults: Mapping[str, Any] | None = None) -> None:
        """Set the counters of ``names`` (as in :meth:`state_dict`) from ``state``. Every value is
        checked before any is set; a key missing from ``state`` takes its value from ``defaults``
        (keyed like ``state``) when there is one.

        Raises:
            gradlens.lens.state.StateDictError (a ValueError and a TypeError): a missing key, or a
                value of the wrong type or range, named with ``where`` (e.g.
                ``"state_dict['gradlens_accumulate']"``).
        """
        names = names if names is not None else {f: f for f in _CHECKS}
        defaults = defaults or {}
        values = {}
        for field, key in names.items():
            if key not in state and key not in defaults:
                raise StateDictError(
                    f"{where} lacks {key!r}; pass the dict that state_dict() returned, unchanged"
                )
            value = state[key] if key in state else defaults[key]
            ok, what = _CHECKS[field]
            if not ok(value):
                raise StateDictError(
                    f"{where}[{key!r}] must be {what}, got {value!r}; the checkpoint is damaged or "
                    "was edited: pass the dict that state_dict() returned, unchanged"
                )
            values[field] = float(value) if field == "samples" else value
        for field, value in values.items():
            setattr(self, field, value)


def counter_property(field: str, doc: str, holder: str = "_counter") -> property:
    """An attribute of a component that is one of its :class:`WindowCounter`'s counters under the
    component's own name (``Lens.step`` is ``updates``, ``AccumulationState.micro_step`` is
    ``micro_steps``), read and set; ``holder`` names the attribute that holds the counter."""
    return property(lambda obj: getattr(getattr(obj, holder), field),
                    lambda obj, value: setattr(getattr(obj, holder), field, value), doc=doc)
