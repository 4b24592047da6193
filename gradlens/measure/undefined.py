"""Parameters whose per-sample gradients are undefined: :class:`UndefinedParams`.

A parameter whose output reaches a layer or operation that mixes the samples of a micro-batch
(train-mode BatchNorm, a softmax over the batch, mixup: found in the forward by
:mod:`gradlens.capture.samples`) has no per-sample gradient. The Lens' ``undefined=`` says what
follows: ``"error"`` names them all and the fix; ``"exclude"`` leaves them out of the Tap (the
rest stay exact) and takes the exact zeros that earlier micro-steps of the window counted for
them (a layer those skipped) out of the window again; ``"contribution"`` keeps measuring them,
each sample's value being its contribution to the micro-step's gradient (:data:`CONTRIBUTION`,
docs/instruments.md "Contributions"), and notes them in the window (``Window.contribution``,
``record.meta["contribution"]``)."""

from __future__ import annotations

from typing import Any

from torch import nn

from gradlens.core.param_shapes import full_numel
from gradlens.core.window import Window

__all__ = ["CONTRIBUTION", "MODES", "UndefinedParams"]

#: the values of ``Lens(undefined=...)``
MODES = ("error", "exclude", "contribution")

#: what a per-sample value is under ``undefined="contribution"`` (``record.meta["units"]`` adds it)
CONTRIBUTION = (
    "the parameters in meta['contribution'] have contributions, not per-sample gradients: "
    "g_m = B_k * dL_k/dtheta_m (mean objective; dL_k/dtheta_m for a sum), the gradient of the "
    "micro-step's objective through sample m's own rows (the batch statistics' paths included), "
    "summing to the micro-step's gradient"
)


class UndefinedParams:
    """The rule of ``Lens(undefined=...)`` and what it left out.

    Attributes:
        mode: ``"error"``, ``"exclude"`` or ``"contribution"``.
        params: parameters left out so far (``"exclude"``): qualified name -> the mixing layer
            or operation.
    """

    def __init__(self, mode: str):
        self.mode = mode
        self.params: dict[str, str] = {}
        # this window's (skipped parameter -> samples counted as zeros, parameters measured)
        self._zeros: dict[str, int] = {}
        self._measured: set[str] = set()

    def new_window(self) -> None:
        self._zeros, self._measured = {}, set()

    def count(self, measured, skipped, batch: int) -> None:
        """A micro-step of ``batch`` samples folded: ``measured`` parameters got values, the
        ``skipped`` ones exact zeros (taken out again if a later micro-step finds one undefined)."""
        self._measured.update(measured)
        for q in skipped:
            self._zeros[q] = self._zeros.get(q, 0) + batch

    def apply(self, bad: dict[str, str], params: dict[str, nn.Parameter], model: nn.Module,
              window: Window | None, per_sample: list[Any]) -> dict[str, nn.Parameter]:
        """``bad`` (name -> mixing layer) found among the tracked ``params``: the parameters to
        track from now on (``"exclude"``, with ``window`` corrected; ``"contribution"``: all of
        them, ``bad`` noted in ``window.contribution``), or a ``RuntimeError`` naming them and
        the fix (``"error"``, or nothing left to track)."""
        if self.mode == "contribution":
            if window is not None:
                window.contribution.update((q, why) for q, why in bad.items() if q not in window.contribution)
            return params
        total = sum(full_numel(p) for p in model.parameters() if p.requires_grad)
        lost = sum(full_numel(params[q]) for q in bad)
        keep = sum(full_numel(p) for p in params.values()) - lost
        layers = sorted(set(bad.values()))
        batchnorm = any("batch statistics" in w for w in layers)  # a layer that eval mode fixes
        if self.mode != "exclude":
            raise RuntimeError(
                f"per-sample gradients of {len(bad)} parameters ({100 * lost / max(total, 1):.2f}% of the "
                f"trainable elements) are undefined: their output reaches {', '.join(layers)}, which "
                f"mixes the samples of a micro-batch: {sorted(bad)}. "
                + ("Put those layers in eval mode, or " if batchnorm else "Compute it per sample, or ")
                + (f"leave these parameters out with Lens(..., undefined='exclude') and track the other "
                   f"{100 * keep / max(total, 1):.2f}% (each such layer's own weight and bias and everything "
                   "after it stay exact), or " if keep else
                   "use only instruments of the window gradient (e.g. GradNorm), which need no per-sample "
                   "gradients (no parameter is left to track), or ")
                + "measure each sample's contribution to the micro-step's gradient "
                "instead (not its own gradient) with Lens(..., undefined='contribution')"
            )
        rest = {q: p for q, p in params.items() if q not in bad}
        if not rest:
            raise RuntimeError(
                f"every tracked parameter reaches a layer or operation that mixes samples ({layers}); "
                "nothing is left to track: " + ("put those layers in eval mode, or " if batchnorm else "")
                + "use only instruments of the window gradient (e.g. GradNorm), which need no "
                "per-sample gradients"
            )
        self._leave_out(bad, params, window, per_sample)
        self.params.update(bad)
        return rest

    def _leave_out(self, bad: dict[str, str], params: dict[str, nn.Parameter], window: Window | None,
                   per_sample: list[Any]) -> None:
        """Parameters found undefined after earlier micro-steps of the window counted them: the
        exact zeros of a layer those skipped are taken out (histogram counts, the sum of squares'
        entry); measured values cannot be, and are refused."""
        if window is None or not window.micro_steps:
            return
        seen = sorted(q for q in bad if q in self._measured)
        if seen:
            raise RuntimeError(
                f"the parameters {seen} were measured in an earlier micro-step of this window and are "
                f"undefined in this one (they reach {sorted(set(bad[q] for q in seen))}); their share of "
                "the window's statistics cannot be taken out: keep what mixes samples the same for every "
                "micro-step of a window (e.g. the layers' train/eval mode set before its first forward)"
            )
        for q in bad:
            count = self._zeros.pop(q, 0)
            window.stats.sum_grad_squared.pop(q, None)
            window.stats.grad_sum.pop(q, None)
            if count:
                for inst in per_sample:
                    inst.update_zeros(window.states[id(inst)], q, params[q], -count)
