"""The arguments every accumulating component checks the same way: ``accum_steps`` (the
micro-steps of a window), ``reduction`` (how the user's loss reduces over its micro-batch) and
``num_samples`` (a micro-step's sample or token count B_k, its weight in a ``"mean"`` window).

Used by :class:`~gradlens.training.accumulate.GradientAccumulateOptimizer`,
:class:`~gradlens.training.accumulate.GradientAccumulateModel` and the accumulation-aware
BatchNorm (:mod:`gradlens.training.batchnorm`). A leaf module: it imports nothing of gradlens.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["REDUCTIONS", "check_accum_steps", "check_num_samples", "check_reduction"]

#: how a loss may reduce over its micro-batch: ``"mean"`` (over its B_k samples) or ``"sum"``
REDUCTIONS = ("mean", "sum")


def check_accum_steps(
    accum_steps: Any,
    meaning: str = "the number of micro-steps per update",
    fix: str = "use accum_steps=1 for no accumulation",
) -> int:
    """``accum_steps`` as an int >= 1, or a TypeError/ValueError that says what it means."""
    if isinstance(accum_steps, bool) or not isinstance(accum_steps, numbers.Integral):
        raise TypeError(
            f"accum_steps must be an int >= 1 ({meaning}), "
            f"got {accum_steps!r} of type {type(accum_steps).__name__}."
        )
    if accum_steps < 1:
        raise ValueError(f"accum_steps must be >= 1 ({meaning}), got {accum_steps}; {fix}.")
    return int(accum_steps)


def check_reduction(reduction: Any) -> str:
    """``reduction`` if it is one of :data:`REDUCTIONS`, else a ValueError naming both."""
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"reduction must be 'mean' (the loss is a mean over its micro-batch) or 'sum' "
            f"(a sum), got {reduction!r}."
        )
    return reduction


def check_num_samples(num_samples: Any) -> float | None:
    """A micro-step's ``num_samples`` (B_k: samples or tokens, > 0 and finite) as a float, or
    None when it was not given (the micro-step then weighs 1)."""
    if num_samples is None:
        return None
    if isinstance(num_samples, bool) or not isinstance(num_samples, numbers.Real):
        raise TypeError(
            f"num_samples must be a positive Python number (the micro-batch's sample or token "
            f"count, e.g. len(x)) or None, got {type(num_samples).__name__}; "
            f"pass int(...) for a tensor count."
        )
    value = float(num_samples)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(
            f"num_samples must be > 0 and finite (the micro-batch's sample count), got "
            f"{num_samples!r}; skip the step() call for an empty micro-batch."
        )
    return value
