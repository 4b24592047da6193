"""Parameters whose per-sample gradients were formed explicitly (a shared parameter's uses
summed, or the exact per-operation fallback): :class:`Materialised` stands in for the module,
:class:`MaterialisedKernel` reads the stored ``[B, *param]`` tensor."""

from __future__ import annotations

import torch
from torch import Tensor

from gradlens.kernels.base import Kernel

__all__ = ["Materialised", "MaterialisedKernel"]


class Materialised:
    """A parameter whose per-sample gradients were formed explicitly (shared parameters summed
    over their uses, or the exact per-operation fallback): ``per_sample`` of
    :class:`MaterialisedKernel` reads slices of the stored ``[B, *param]`` tensor (passed as
    the kernel's ``a``)."""

    def __init__(self, attr: str, param: Tensor):
        setattr(self, attr, param)
        self._attr = attr

    def named_parameters(self, recurse: bool = False):
        return [(self._attr, getattr(self, self._attr))]

    def parameters(self, recurse: bool = False):
        return [getattr(self, self._attr)]


class MaterialisedKernel(Kernel):
    """Kernel of a :class:`Materialised` parameter: ``a`` is ``[B, *param]``, ``delta`` unused.
    The per-sample gradients are its input, so the sums and norms are reductions of it
    (``factored``: no materialising pass; the sum of squares squares bounded slices)."""

    factored = True

    def batch_l2(self, module, a, delta):
        return {module._attr: torch.linalg.vector_norm(a.reshape(a.shape[0], -1), dim=1).square()}

    def sum_grad_squared(self, module, a, delta):
        # Kernel's chunked squares are right here (the slices are the input itself); defined
        # so that check_kernel sees that a factored kernel states its own sums
        return super().sum_grad_squared(module, a, delta)

    def grad_sum(self, module, a, delta):
        return {module._attr: a.sum(0)}

    def per_sample(self, module, a, delta, start, stop, attrs=None):
        return {module._attr: a[start:stop]}

    def entries(self, module, a, delta, attr, j):
        return a.reshape(a.shape[0], -1).index_select(1, j)
