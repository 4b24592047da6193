"""The events the capture hands down to the Meter (:mod:`gradlens.measure.meter`) in backward:
a closed-form use (:class:`Site`, through an :data:`OnUse` callback), an operation use
(:class:`OpUse`), and the slot through which a fused ``nn.Linear`` call receives the dL/dW the
measurement formed (:class:`WeightGrad`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import Tensor

from gradlens.kernels.base import Kernel

__all__ = ["Site", "OnUse", "OpUse", "WeightGrad"]


@dataclass(eq=False)
class Site:
    """One use of tracked parameters with a closed-form kernel: a module call, an ``F.linear``
    call, or (built by the Lens) a parameter whose per-sample gradients were materialised.

    Attributes:
        name: unique within a micro-step, stable across micro-steps (module name, or
            ``"op<k>:<param>"`` for the k-th operation of a forward).
        module: what the kernel reads (the module, or a stand-in with the same attributes).
        kernel: the :class:`~gradlens.kernels.Kernel`.
        params: attribute (``"weight"``) -> qualified name of the tracked parameter.
    """

    name: str
    module: Any
    kernel: Kernel
    params: dict[str, str]

    def only(self, attrs) -> "Site":
        """The same use restricted to the parameters ``attrs``."""
        return Site(self.name, self.module, self.kernel, {a: q for a, q in self.params.items() if a in attrs})


#: Called in backward (:meth:`gradlens.measure.meter.Meter.on_use`): (site, input a [B, ...], output
#: gradient [B, ...], the attributes whose dL/dp comes via the call's autograd node (a frozenset;
#: see _hook_param_grads), micro-batch size seen in forward, id
#: of that forward pass; keyword ``fused=True`` for a fused Linear call), returning that call's
#: dL/dW when the measurement formed it (else None)
OnUse = Callable[..., "Tensor | None"]


@dataclass(eq=False)
class OpUse:
    """An operation where tracked parameters (or tensors derived from parameters only) meet the
    batch; per-sample gradients follow :func:`gradlens.capture.ops.per_sample_wrt`."""

    name: str
    func: Callable
    args: tuple
    kwargs: dict
    inputs: list  # (position, tensor, frozenset of qualified names)
    axis: int
    batch: int
    forward: int = 0  # id of the forward pass
    #: rows per sample on ``axis`` (its size is ``batch * factor``, samples the leading factor)
    factor: int = 1
    #: the sample of each row of ``axis`` where they are not the samples in order (a
    #: :class:`~gradlens.capture.rows.Rows` axis: reordered, selected or repeated rows); sample
    #: n's gradient is the sum over its rows
    rows: Any = None


class WeightGrad:
    """One call of a fused ``nn.Linear`` (:func:`gradlens.capture.fused._fused_forward`): its dL/dW when the
    Meter formed it while measuring the call (the sum of the per-sample gradients it
    materialised anyway, divided by the per-sample scale), else None and the call's backward
    computes it. Written only by the output hook of :meth:`gradlens.capture.tap.Tap._site_use` (from the value
    :meth:`gradlens.measure.meter.Meter.on_use` returns), read by :class:`gradlens.capture.fused._FusedLinear`."""

    __slots__ = ("value",)

    def __init__(self):
        self.value: Tensor | None = None
