"""The window of a :class:`~gradlens.training.accumulate.GradientAccumulateOptimizer` as one
value: :class:`AccumulationState` (optax's ``MultiStepsState`` in spirit), with the fold of a
micro-step's gradient into it.

Under ``reduction="mean"`` the accumulator of a parameter is the running weighted mean of the
micro-step gradients it received, ``sum_k w_k grad_k / W_p`` (w_k = ``num_samples`` of micro-step
k, or 1; W_p = the window's weight when the accumulator was last written), each fold one
``lerp``; under ``"sum"`` it is the running sum ``sum_k grad_k``. Both are unscaled (a GradScaler's
scale is divided out as they are folded) and kept in the wider of the accumulation dtype and the
parameter's dtype. The state's ``state_dict`` section is :mod:`gradlens.training.accum_section`.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from gradlens import compat
from gradlens.core.counter import WindowCounter, counter_property
from gradlens.training.accum_section import load_section, write_section

__all__ = ["AccumulationState"]


@dataclass
class AccumulationState:
    """Everything a :class:`~gradlens.training.accumulate.GradientAccumulateOptimizer` knows
    about its current window and its history (optax ``MultiStepsState`` in spirit).

    Attributes:
        counter: the window lifecycle (:class:`~gradlens.core.counter.WindowCounter`): micro-steps and
            their weight in the open window, real updates, skipped windows, ``has_updated``;
            the five attributes below are its counters under the wrapper's names.
        micro_step: micro-steps folded into the open window.
        iterations: real updates so far.
        skipped_windows: windows skipped (inf/nan under a GradScaler, or with ``skip_nonfinite=True``).
        has_updated: whether the last ``step()``/``flush()`` made a real update.
        weight: sum of the window's micro-step weights (``num_samples``, or 1 each).
        weighted: whether the window's micro-steps gave ``num_samples`` (None: none yet).
        via_scaler: whether they came through a GradScaler (None: none yet).
        accumulators: parameter -> the window so far ``[*param]`` (accumulation dtype): under
            ``reduction="mean"`` the running weighted mean ``sum_k w_k grad_k / W_p`` with W_p
            = ``last_weight[p]``, under "sum" the running sum ``sum_k grad_k`` (unscaled).
        last_weight: parameter -> the window's weight when its accumulator was last written.
        versions: parameter -> its accumulator's tensor version after the wrapper's last write
            (a change made elsewhere is an error, not a wrong window).
        fused: parameters whose window gradient the closing micro-step wrote straight into
            ``p.grad``.
        pool: parameter -> a buffer for its accumulator where the micro-step's ``p.grad``
            cannot be kept as it, reused from window to window (a fresh allocation per window
            costs more than the fold itself on CPU: first-touch page faults).
        folded: parameter -> (weak reference to the ``p.grad`` folded last, its version), to
            tell a second ``step()`` or a missing ``zero_grad()`` from a fresh gradient.
        noted_samples: the micro-batch size a Lens reported for the coming ``step()``.
    """

    counter: WindowCounter = field(default_factory=WindowCounter)
    weighted: bool | None = None
    via_scaler: bool | None = None
    accumulators: dict = field(default_factory=dict)
    last_weight: dict = field(default_factory=dict)
    versions: dict = field(default_factory=dict)
    fused: set = field(default_factory=set)
    pool: dict = field(default_factory=dict)
    folded: dict = field(default_factory=dict)
    noted_samples: int | None = None

    micro_step = counter_property("micro_steps", "micro-steps folded into the open window", "counter")
    iterations = counter_property("updates", "real updates so far", "counter")
    skipped_windows = counter_property("skipped", "windows skipped (inf/nan under a GradScaler, or skip_nonfinite=True)", "counter")
    has_updated = counter_property("has_updated", "whether the last step()/flush() made a real update", "counter")
    weight = counter_property("samples", "sum of the window's micro-step weights (num_samples, or 1 each)", "counter")

    def reset_window(self) -> None:
        self.counter.clear()
        self.weighted, self.via_scaler = None, None
        self.accumulators, self.last_weight, self.versions, self.fused = {}, {}, {}, set()

    def skip(self) -> None:
        """End the window without an update: its gradients are dropped and it is counted."""
        self.reset_window()
        self.counter.close(updated=False)

    def finite(self) -> bool:
        """Whether every accumulator is finite (one device sync per window, scaler only)."""
        accs = list(self.accumulators.values())
        if not accs:
            return True
        return bool(torch.stack([torch.isfinite(a).all() for a in accs]).all())

    def check_untouched(self, p: Tensor, acc: Tensor) -> None:
        """Raise if ``acc`` (``p``'s accumulator) was changed since the wrapper last wrote it."""
        if compat.tensor_version(acc) != self.versions.get(p):
            raise RuntimeError(
                "the window's accumulated gradient was changed outside the wrapper: "
                "GradientAccumulateOptimizer keeps the window's first p.grad as its accumulator, "
                "and something modified it in place (model.zero_grad(set_to_none=False) zeroes "
                "p.grad in place); clear gradients with opt.zero_grad() or "
                "model.zero_grad(set_to_none=True)"
            )

    def section(self, params: Sequence[Tensor], accum_steps: int, reduction: str) -> dict[str, Any]:
        """The wrapper's versioned ``state_dict`` section: the counters, the window's weight and
        its accumulators keyed by the parameter's flat index in ``params`` (copies: later windows
        are written into the same buffers); see :func:`gradlens.training.accum_section.write_section`."""
        return write_section(self, params, accum_steps, reduction)

    @classmethod
    def from_section(cls, section: dict[str, Any], params: Sequence[Tensor], accum_steps: int, reduction: str,
                     accum_dtype: torch.dtype) -> "AccumulationState":
        """The state saved by :meth:`section` (any version gradlens reads), checked against the
        wrapper that loads it (:func:`gradlens.training.accum_section.load_section`).

        Raises:
            ValueError: wrong section version, another ``reduction``, a saved mid-window micro-step
                count not below ``accum_steps``, or accumulators whose index or shape does not
                match ``params``.
        """
        return load_section(cls(), section, params, accum_steps, reduction, accum_dtype)

    def fold(self, params: Sequence[Tensor], weight: float, grad_scale: Tensor | float | None, *,
             mean: bool, accum_steps: int, accum_dtype: torch.dtype) -> None:
        """Fold this micro-step's ``p.grad`` (weight ``weight``) into the accumulators; on the
        window's closing micro-step (no GradScaler) the window gradient goes straight into
        ``p.grad`` instead (``fused``). The window's counters (``micro_step``, ``weight``) are the
        caller's to advance."""
        st = self
        w_prev = st.weight
        w_new = w_prev + weight
        closing = st.micro_step + 1 >= accum_steps and grad_scale is None
        share = weight / w_new if mean else 1.0  # this micro-step's share of the window so far
        factor: Tensor | float = share  # ... and of its unscaled gradient
        if isinstance(grad_scale, Tensor):
            factor = share / grad_scale.double()
        elif grad_scale is not None:
            factor = share / grad_scale
        for p in params:
            grad = p.grad
            if grad is None:
                continue
            st.folded[p] = (weakref.ref(grad), compat.tensor_version(grad))
            if grad.is_sparse:
                raise RuntimeError(
                    "GradientAccumulateOptimizer does not support sparse gradients; use a dense "
                    "embedding (sparse=False)."
                )
            dtype = torch.promote_types(accum_dtype, p.dtype)
            plain = grad_scale is None and grad.dtype == dtype and not grad.requires_grad
            f = factor.to(p.device, dtype) if isinstance(factor, Tensor) else factor
            acc = st.accumulators.get(p)
            if acc is None:
                if closing and plain:  # p's only gradient of the window: it is the window gradient
                    if share != 1.0:
                        grad.mul_(share)
                    st.fused.add(p)
                    continue
                if plain and share == 1.0 and not compat.is_view(grad):
                    acc = grad  # kept as the accumulator, no copy (zero_grad() hands p.grad back)
                else:
                    acc = st.pool.get(p)
                    if acc is None or acc.shape != p.shape or acc.dtype != dtype or acc.device != p.device:
                        acc = torch.empty_like(p, dtype=dtype, memory_format=torch.preserve_format)
                        st.pool[p] = acc
                    torch.mul(grad.detach(), f, out=acc)
                st.accumulators[p] = acc
                st.last_weight[p] = w_new
                st.versions[p] = compat.tensor_version(acc)
                continue
            st.check_untouched(p, acc)
            grad = grad.detach()
            keep = st.last_weight[p] / w_new if mean else 1.0  # the accumulator's share
            in_step = st.last_weight[p] == w_prev  # p was folded at the last micro-step too
            if closing and plain:  # the window gradient straight into this micro-step's p.grad
                if mean and in_step:
                    torch.lerp(acc, grad, share, out=grad)
                elif mean:
                    grad.mul_(share).add_(acc, alpha=keep)
                else:
                    grad.add_(acc)
                st.fused.add(p)
                continue
            if mean and in_step and plain:
                acc.lerp_(grad, share)
            else:
                if keep != 1.0:
                    acc.mul_(keep)
                if isinstance(f, Tensor):
                    acc.addcmul_(grad, f)
                else:
                    acc.add_(grad, alpha=f)
            st.last_weight[p] = w_new
            st.versions[p] = compat.tensor_version(acc)
