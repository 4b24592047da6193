"""Routed expert parameters measured in factored form: the uses of one 3-D expert weight in a
micro-step (the eager loop's ``F.linear(x, w[e])``, one per expert hit; ``grouped_mm`` with
offsets) are slices of one parameter, kept as their tokens' factors
(:func:`gradlens.capture.ops.routed_factors`, in ``micro.routed``) and measured once at the
micro-step's end as one use of :class:`gradlens.kernels.routed.RoutedKernel`: g_n is the sum of
those uses, and no ``[B, E, p1, p2]`` is formed."""

from __future__ import annotations

import torch

from gradlens.capture.events import Site
from gradlens.capture.units import MicroStep
from gradlens.kernels.routed import Routed, RoutedKernel, pack

__all__ = ["measure"]

_KERNEL = RoutedKernel()


def measure(meter, micro: MicroStep) -> None:
    """Measure each routed parameter of ``micro`` (its uses' tokens joined) for ``meter``
    (:class:`gradlens.measure.meter.Meter`); a parameter that also had other uses this
    micro-step (kept materialised in ``micro.shared``) gets its routed part added there."""
    for q, parts in micro.routed.items():
        param = meter.tap.params[q]
        owner, expert, u, v = (torch.cat([p[i] for p in parts]) for i in range(4))
        a, delta = pack(owner, expert, u, v, parts[0][4])
        site = Site(f"routed:{q}", Routed("p", param), _KERNEL, {"p": q})
        if q in micro.shared:
            _KERNEL.add_per_sample(site.module, a, delta, "p", micro.shared[q])
        else:
            meter.measure_use(site, a, delta, micro)
    micro.routed = {}
