"""``lens.capture(multiplier=..., loss=...)``: a stated factor that gradlens also measures is
refused, never divided out twice.

The two arguments have one meaning each (docs/integrations.md, "Units of a capture"):

- ``loss=`` names the loss tensor as computed; whatever multiplies it on its way to
  ``backward`` (a loop's ``1 / K``, a GradScaler's scale) is *measured* there and divided out.
- ``multiplier=`` states a factor gradlens cannot see: with ``loss=``, one *inside* it (``loss``
  is ``multiplier`` times the micro-step's mean objective: a declared window objective, as the
  Hugging Face Trainer's ``B_k / N``); without ``loss=``, the factor between the micro-step's
  objective and what is backpropagated.

A loop that states with ``multiplier=`` the very factor it applies between ``loss`` and
``backward`` (``capture(reduction="mean", multiplier=1/K, loss=raw)`` around
``(raw / K).backward()``) would have it divided out twice: :class:`StatedFactors` sees the
measured factor equal to the stated one (or to it times the Lens's GradScaler scale) and
refuses the window. On the CPU at once; on an accelerator the comparison stays on the device
and is read when the window closes (no host read per micro-step).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gradlens import compat
from gradlens.core.sync import device_paths

__all__ = ["StatedFactors"]


def _message(stated: float, measured: float) -> str:
    return (
        f"lens.capture(multiplier={stated:g}, loss=...): gradlens measured the factor {measured:g} between "
        "loss and the backward (the loss was multiplied by it before .backward()), which is the stated "
        "factor: it would be divided out twice. With loss=, multiplier= states a factor inside loss (loss "
        "is multiplier x the micro-step's mean objective: a declared window objective, as the Trainer's "
        "B_k / N); a factor applied to loss on its way to backward (a loop's loss / K, a GradScaler's "
        "scale) is measured. Drop multiplier=: lens.capture(reduction='mean', loss=loss). This window's "
        "statistics are dropped"
    )


class StatedFactors:
    """The stated ``multiplier=`` of each explicit capture against the factor measured between
    its ``loss=`` and the backward. ``pending``: on an accelerator, ``(flag, stated, measured)``
    0-d tensors of the window's micro-steps, read by :meth:`verify`."""

    def __init__(self) -> None:
        self.pending: list[tuple[Tensor, Tensor, Tensor]] = []

    def check(self, micro: Any, scaler: Any) -> bool:
        """After a captured backward: False, or True (the window must be dropped and
        :meth:`error` raised) when ``micro``'s stated factor equals the measured one."""
        stated = micro.factor
        if stated is None or not micro.loss_calls:
            return False
        measured = micro.loss_calls[0].multiplier
        if measured is None:
            return False
        measured = measured.detach().reshape(()).double()
        m = torch.as_tensor(stated, dtype=torch.float64, device=measured.device).reshape(())
        candidates = [m]
        scale = compat.grad_scaler_scale(scaler) if scaler is not None else None
        if scale is not None:
            candidates.append(m * scale.to(device=measured.device, dtype=torch.float64))
        flag = torch.stack([(measured - c).abs() <= 1e-6 * c.abs() for c in candidates]).any() & ((m - 1).abs() > 1e-6)
        if device_paths(measured):
            self.pending.append((flag, m, measured))
            return False
        if bool(flag):
            self.pending = [(flag, m, measured)]
            return True
        return False

    def verify(self) -> bool:
        """When the window closes: True if a micro-step of it stated a measured factor (then
        :meth:`error` names it); one host read for all its micro-steps."""
        if not self.pending:
            return False
        flags = torch.stack([f for f, _, _ in self.pending])
        if not bool(flags.any()):
            self.pending = []
            return False
        first = int(torch.nonzero(flags)[0])
        self.pending = [self.pending[first]]
        return True

    def verify_or_raise(self, drop) -> None:
        """:meth:`verify`; on a stated factor, ``drop()`` the window and raise :meth:`error`."""
        if self.verify():
            err = self.error()
            drop()
            raise err

    def error(self) -> ValueError:
        """The error of the factor found by :meth:`check` or :meth:`verify` (and forget it)."""
        _, stated, measured = self.pending[0]
        self.pending = []
        return ValueError(_message(float(stated), float(measured)))
