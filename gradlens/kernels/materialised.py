"""Parameters whose per-sample gradients were formed explicitly (a shared parameter's uses
summed, or the exact per-operation fallback): :class:`Materialised` stands in for the module,
:class:`MaterialisedKernel` reads the stored ``[B, *param]`` tensor; :class:`SummedUsesKernel`
forms a shared parameter's g_n (the sum over its uses) one slice of samples at a time, so that
no ``[B, *param]`` tensor is held."""

from __future__ import annotations

import torch
from torch import Tensor

from gradlens.kernels.base import Kernel, sample_chunks, zeros_into
from gradlens.core.limits import CHUNK_ELEMENTS

__all__ = ["Materialised", "MaterialisedKernel", "SummedUsesKernel"]


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

    def reduce(self, module, a, delta, want, names, acc, skip=()):
        """The sums in place: ``acc += sum_n g_n * g_n`` and ``sum_n g_n`` slice by slice of
        samples (one sample at a time where one holds more than :data:`CHUNK_ELEMENTS`
        elements: ``addcmul_``, no temporary of the parameter's size); returns ``[B]``
        ||g_n||^2 if ``"batch_l2"`` is wanted."""
        attr = module._attr
        q = names.get(attr)
        squares = q is not None and "sum_grad_squared" in want and ("sum_grad_squared", attr) not in skip
        total = q is not None and "grad_sum" in want and ("grad_sum", attr) not in skip
        norms = q is not None and "batch_l2" in want
        b, shape = a.shape[0], tuple(a.shape[1:])
        sq = zeros_into(acc["sum_grad_squared"], q, shape, a) if squares else None
        tot = zeros_into(acc["grad_sum"], q, shape, a) if total else None
        flat = a.reshape(b, -1)
        l2 = a.new_empty(b) if norms else None
        for s, e in sample_chunks(flat.shape[1], b, CHUNK_ELEMENTS):
            g = flat[s:e]
            if e - s == 1:  # one large sample: every sum in place
                if sq is not None:
                    sq.view(-1).addcmul_(g[0], g[0])
                if tot is not None:
                    tot.view(-1).add_(g[0])
                if l2 is not None:
                    l2[s] = torch.dot(g[0], g[0])
                continue
            gg = g.square() if sq is not None or l2 is not None else None  # [c, numel], a bounded slice
            if sq is not None:
                sq.view(-1).add_(gg.sum(0))
            if tot is not None:
                tot.view(-1).add_(g.sum(0))
            if l2 is not None:
                torch.sum(gg, 1, out=l2[s:e])
        return [l2] if norms else []

    def entries(self, module, a, delta, attr, j):
        return a.reshape(a.shape[0], -1).index_select(1, j)


class SummedUsesKernel(Kernel):
    """Kernel of a shared parameter (a :class:`Materialised` stand-in) whose per-sample gradients
    are the sum over its uses, kept as ``uses``: ``[(site, attr, a, delta)]`` (each use's
    kernel, module, the attribute of the parameter in it, its input and per-sample output
    gradient). :meth:`per_sample` forms samples ``start:stop`` of that sum (the first use's
    slice, the others added into it by :meth:`~gradlens.kernels.Kernel.add_per_sample`), so a
    materialising pass holds one slice, never ``[B, *param]``. Its own ``a`` and ``delta`` are
    ``[B]`` stand-ins (the batch size)."""

    factored = False

    def __init__(self, uses: list):
        self.uses = uses

    def per_sample(self, module, a, delta, start, stop, attrs=None):
        out = None
        for site, attr, ua, ud in self.uses:
            if out is None:
                out = site.kernel.per_sample(site.module, ua, ud, start, stop, attrs=[attr])[attr]
                if _overlaps(out, ua) or _overlaps(out, ud):  # a view of a use's tensors: added into
                    out = out.clone()
            else:
                site.kernel.add_per_sample(site.module, ua[start:stop], ud[start:stop], attr, out)
        return {module._attr: out}


def _overlaps(t: Tensor, other: Tensor) -> bool:
    """Whether ``t`` lies on the memory of ``other`` (a view of it)."""
    return t.untyped_storage().data_ptr() == other.untyped_storage().data_ptr()
