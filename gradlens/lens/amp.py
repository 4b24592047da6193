"""Mixed precision and the Lens' windows: a window whose optimizer step a ``torch.amp.GradScaler``
skipped (inf/nan gradients) has no update, so its statistics must be dropped, not merged into the
next window.

A :class:`~gradlens.GradientAccumulateOptimizer` reports such windows itself (its window-end
hook). With a plain ``torch.optim`` optimizer, ``GradScaler.step`` skips the optimizer's step
without any hook firing; :class:`ScalerSkips` sees it through the public ``get_scale()``: the scale
fell since the window opened. :func:`warn_nonfinite` flags the record that an unknown GradScaler
would leave behind.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Iterable

import torch
from torch import Tensor

from gradlens.core.records import Record
from gradlens.core.counter import WindowCounter
from gradlens.training.accum_optimizer import GradientAccumulateOptimizer

__all__ = ["ScalerSkips", "warn_nonfinite"]


class ScalerSkips:
    """The windows a GradScaler skipped, seen with a plain ``torch.optim`` optimizer
    (``Lens(grad_scaler=...)``): one ``get_scale()`` host read when a tracked window opens, one
    at each capture of it."""

    def __init__(self, scaler: Any):
        self.scaler = scaler
        self.scale_at_open: float | None = None

    def window_opened(self) -> None:
        """A tracked window opens: note the scale (nothing without a scaler)."""
        if self.scaler is not None:
            self.scale_at_open = float(self.scaler.get_scale())

    def drop_skipped(self, step: int, counter: WindowCounter) -> bool:
        """At a capture of a window that holds micro-steps: whether the scaler skipped the step
        that should have closed it (``scaler.update()`` lowered the scale since the window
        opened). If so the window is counted as skipped in ``counter`` and a warning names it;
        the caller drops its statistics (no record), as for a window a
        :class:`~gradlens.GradientAccumulateOptimizer` skipped."""
        scaler = self.scaler
        if scaler is None:
            return False
        if self.scale_at_open is None or not float(scaler.get_scale()) < self.scale_at_open:
            return False
        counter.close(updated=False)
        warnings.warn(
            f"window {step} was dropped: the GradScaler skipped its optimizer step "
            f"(inf/nan; the scale fell to {float(scaler.get_scale())}); no record, "
            f"lens.skipped_windows={counter.skipped}",
            RuntimeWarning,
            stacklevel=4,
        )
        return True


def warn_nonfinite(record: Record, optimizer: Any, grad_scaler: Any, params: Iterable[Tensor] = ()) -> None:
    """A record with inf/nan gradients behind a real update, under a plain optimizer and no
    GradScaler known to the Lens. ``params`` (the tracked parameters) tell the two causes
    apart: the optimizer's own ``p.grad`` holds inf/nan too, so this window's inputs, loss or
    parameters were not finite (a GradScaler would have skipped that step); or ``p.grad`` is
    finite, so the inf/nan came from an earlier window whose step a GradScaler unknown to the
    Lens skipped, merged into this one."""
    if optimizer is None or isinstance(optimizer, GradientAccumulateOptimizer):
        return
    if grad_scaler is not None:
        return
    gn, l2 = record.get("grad_norm"), record.get("batch_l2")
    bad = (isinstance(gn, float) and not math.isfinite(gn)) or (
        isinstance(l2, Tensor) and not bool(torch.isfinite(l2).all())
    )
    if not bad:
        return
    grads = [p.grad for p in params if p.grad is not None]
    stepped_bad = bool(grads) and not bool(torch.stack(
        [torch.isfinite(g.coalesce().values() if g.is_sparse else g).all() for g in grads]).all())
    if stepped_bad:
        message = (
            f"the record of window {record.step} holds inf/nan per-sample gradients, and so did "
            "the gradient the optimizer stepped with (p.grad): this window's inputs, loss or "
            "parameters were not finite (no GradScaler skipped this step; the update applied "
            "them). Check the data and the loss (e.g. torch.isfinite(x).all()); to skip such "
            "steps use a torch.amp.GradScaler, or GradientAccumulateOptimizer(..., "
            "skip_nonfinite=True)"
        )
    else:
        message = (
            f"the record of window {record.step} holds inf/nan per-sample gradients although "
            "the optimizer updated with a finite gradient: if a GradScaler skipped an earlier "
            "step, that window was merged into this one; pass Lens(..., grad_scaler=scaler) so "
            "skipped windows are dropped"
        )
    warnings.warn(message, RuntimeWarning, stacklevel=3)
