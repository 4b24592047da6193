"""GradScaler and inf/nan in an accumulated window: where a micro-step's scale comes from, that a
window's micro-steps all take the same route, and what a window with inf/nan does.

Under a ``torch.amp.GradScaler`` the wrapper
(:class:`~gradlens.training.accumulate.GradientAccumulateOptimizer`) declares
``_step_supports_amp_scaling``, so ``scaler.step(opt)`` calls its ``step`` on every micro-step with
``p.grad`` still scaled; the scale of that micro-step (:func:`grad_scale`) is divided out as the
gradient is folded, and the window's accumulators are checked for inf/nan once, when it closes
(:meth:`~gradlens.training.accum_state.AccumulationState.finite`): a window with one is skipped.
Without a scaler the closing window's gradient is checked once (:func:`grads_finite`) and
:func:`warn_nonfinite` says whether it was applied or skipped (``skip_nonfinite``). The scaler's
own inf/nan bookkeeping is never read.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from gradlens import compat

__all__ = ["check_route", "grad_scale", "grads_finite", "warn_nonfinite"]


def grad_scale(optimizer: Any, grad_scaler: Any) -> Tensor | float | None:
    """The GradScaler scale of this micro-step's gradients (a float, or a 0-d tensor), or None
    outside a scaler.

    ``scaler.step(opt)`` calls the wrapper's ``step`` (``_step_supports_amp_scaling``) with
    ``p.grad`` still scaled. With ``grad_scaler`` given the scale comes from
    :func:`gradlens.compat.grad_scaler_scale` (one host read, as ``get_scale()``); otherwise
    from the ``grad_scale`` tensor GradScaler attaches to such an ``optimizer`` during the call
    (its protocol for them; read here only)."""
    if grad_scaler is not None:  # every micro-step goes through scaler.step(opt)
        scale = compat.grad_scaler_scale(grad_scaler)  # float(): get_scale(); None: unscaled
        return None if scale is None else float(scale)
    return compat.optimizer_grad_scale(optimizer)


def check_route(earlier: bool | None, via_scaler: bool) -> None:
    """Raise if this micro-step came through a GradScaler (``via_scaler``) and the window's
    earlier micro-steps did not, or the other way round (``earlier``: their route, None before
    the window's first micro-step): scaled and unscaled gradients cannot be summed."""
    if earlier is not None and earlier != via_scaler:
        raise RuntimeError(
            "this micro-step came "
            + ("through scaler.step(opt)" if via_scaler else "through opt.step()")
            + " but the earlier micro-steps of the window did not; with a GradScaler call "
            "scaler.step(opt) and scaler.update() on every micro-step (the scaled gradients "
            "of every micro-step must be unscaled before they are summed)."
        )


def grads_finite(params: Sequence[Tensor]) -> bool:
    """Whether every ``p.grad`` of ``params`` is finite: one reduction, one host read."""
    flags = [
        torch.isfinite(compat.sparse_values(g)).all()
        for g in (p.grad for p in params) if g is not None
    ]
    return bool(torch.stack(flags).all()) if flags else True


def warn_nonfinite(iterations: int, skipped_windows: int, skip: bool, stacklevel: int) -> None:
    """The ``RuntimeWarning`` for a window whose gradient holds inf/nan without a GradScaler:
    it names the window (0-based, ``iterations + skipped_windows``) and what was done with it
    (``skip``: skipped, as ``skip_nonfinite=True`` asks; else applied), and the fix.
    ``stacklevel`` is ``warnings.warn``'s, counted from this function."""
    window = iterations + skipped_windows
    fix = (
        "the update was skipped (skip_nonfinite=True)" if skip else
        "the update was applied with them; use a torch.amp.GradScaler "
        "(GradientAccumulateOptimizer(..., grad_scaler=scaler)) or "
        "GradientAccumulateOptimizer(..., skip_nonfinite=True) to skip such windows"
    )
    warnings.warn(
        f"GradientAccumulateOptimizer: window {window} (0-based; {iterations} real "
        f"updates so far) has an inf/nan gradient; {fix}",
        RuntimeWarning,
        stacklevel=stacklevel + 1,
    )
