"""The kernel of ``nn.Bilinear``, a layer with two inputs: ``y = x1^T W x2 + b``.

For inputs ``x1 [B, *, I1]``, ``x2 [B, *, I2]`` and output gradient ``delta [B, *, O]`` (the
positions ``*`` flattened to T), sample n's gradient is

    g_n(W)[o, i, j] = sum_t delta_nto x1_nti x2_ntj,        g_n(b)[o] = sum_t delta_nto,

a sum of rank-one three-way products. Everything the Lens asks for comes from the three factors,
with memory O(B (I1 + I2 + O)) per use (plus ``B T^2`` where T > 1), never the ``[B, O, I1, I2]``
per-sample weight gradients:

- ||g_n(W)||^2 = sum_{t,s} (delta_nt . delta_ns)(x1_nt . x1_ns)(x2_nt . x2_ns)
  (T = 1: the product of the three squared norms);
- sum_n g_n(W)^2 = sum_n delta_n^2 (x) x1_n^2 (x) x2_n^2 for T = 1 (one ``einsum``); with
  positions, slices of samples materialised within :data:`~gradlens.core.limits.CHUNK_ELEMENTS`;
- the Gram g_n . g_m by the same identity across samples, the projection <D, g_n> as one
  bilinear map of the inputs along D, and single entries g_n[o, i, j] by gathering the factors.

The use carries both inputs: the capture joins them along the last axis (``[B, *, I1 + I2]``,
:meth:`BilinearKernel.join_inputs`), so that every consumer of a use (stacking, cross-micro-step
pieces, rank merging) keeps one tensor per use.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradlens.kernels.base import Kernel, _cat, sample_chunks

__all__ = ["BilinearKernel"]


def _factors(module: nn.Bilinear, a: Tensor, delta: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(x1 [B, T, I1], x2 [B, T, I2], d [B, T, O])`` from the joined input ``a [B, *, I1 + I2]``."""
    b, i1 = delta.shape[0], module.in1_features
    a = a.reshape(b, -1, a.shape[-1])
    return a[..., :i1], a[..., i1:], delta.reshape(b, -1, delta.shape[-1])


class BilinearKernel(Kernel):
    """``nn.Bilinear``: per-sample quantities from the factors ``x1``, ``x2``, ``delta`` (see the
    module docstring). Two inputs (:attr:`inputs`), joined by :meth:`join_inputs`."""

    factored = True
    inputs = 2

    def join_inputs(self, module, inputs: tuple[Tensor, ...]) -> Tensor:
        """``[B, *, I1 + I2]``: both inputs side by side (batch-first, same leading shape)."""
        x1, x2 = inputs
        return torch.cat([x1, x2.to(x1.dtype)], dim=-1)

    def sum_cost(self, module, a, out):
        return a.numel() * out.shape[-1] * module.in2_features

    # ---- per-sample gradients (materialised, for histograms and slices) -------------------
    def per_sample(self, module, a, delta, start, stop, attrs=None):
        x1, x2, d = _factors(module, a, delta)
        want = self.params(module) if attrs is None else attrs
        out = {}
        if "weight" in want:
            out["weight"] = torch.einsum("bto,bti,btj->boij", d[start:stop], x1[start:stop], x2[start:stop])
        if "bias" in want:
            out["bias"] = d[start:stop].sum(1)
        return out

    def add_per_sample(self, module, a, delta, attr, out):
        for s, e in self._chunks(module, delta.shape[0]):
            out[s:e].add_(self.per_sample(module, a, delta, s, e, attrs=[attr])[attr])

    def entries(self, module, a, delta, attr, j):
        x1, x2, d = _factors(module, a, delta)
        if attr == "bias":
            return d.sum(1).index_select(1, j)
        i1, i2 = module.in1_features, module.in2_features
        o, rest = j // (i1 * i2), j % (i1 * i2)
        return (d.index_select(2, o) * x1.index_select(2, rest // i2) * x2.index_select(2, rest % i2)).sum(1)

    # ---- sums of the window (factored) -----------------------------------------------------
    def batch_l2(self, module, a, delta):
        x1, x2, d = _factors(module, a, delta)
        out = {}
        attrs = self.params(module)
        if x1.shape[1] == 1:
            dd = d.square().sum((1, 2))
            if "weight" in attrs:
                out["weight"] = dd * x1.square().sum((1, 2)) * x2.square().sum((1, 2))
            if "bias" in attrs:
                out["bias"] = dd
            return out
        dd = torch.einsum("nto,nso->nts", d, d)
        if "weight" in attrs:
            out["weight"] = (dd * torch.einsum("nti,nsi->nts", x1, x1) * torch.einsum("ntj,nsj->nts", x2, x2)).sum((1, 2))
        if "bias" in attrs:
            out["bias"] = d.sum(1).square().sum(1)
        return out

    def sum_grad_squared(self, module, a, delta):
        x1, x2, d = _factors(module, a, delta)
        attrs = self.params(module)
        out = {}
        if "weight" in attrs:
            if x1.shape[1] == 1:
                out["weight"] = torch.einsum("no,ni,nj->oij", d[:, 0].square(), x1[:, 0].square(), x2[:, 0].square())
            else:  # positions: slices of samples materialised within the chunk budget
                parts = None
                for s, e in self._chunks(module, d.shape[0]):
                    sq = self.per_sample(module, a, delta, s, e, attrs=["weight"])["weight"].square().sum(0)
                    parts = sq if parts is None else parts.add_(sq)
                out["weight"] = parts
        if "bias" in attrs:
            out["bias"] = d.sum(1).square().sum(0)
        return out

    def grad_sum(self, module, a, delta):
        x1, x2, d = _factors(module, a, delta)
        attrs = self.params(module)
        out = {}
        if "weight" in attrs:
            out["weight"] = torch.einsum("nto,nti,ntj->oij", d, x1, x2)
        if "bias" in attrs:
            out["bias"] = d.sum((0, 1))
        return out

    # ---- cross-micro-step maths ------------------------------------------------------------
    def directional(self, module, a, delta, direction, attrs):
        x1, x2, d = _factors(module, a, delta)
        out = d.new_zeros(d.shape[0])
        if "weight" in attrs:
            out = out + (F.bilinear(x1, x2, direction["weight"].to(d.dtype)) * d).sum((1, 2))
        if "bias" in attrs:
            out = out + d.sum(1) @ direction["bias"].to(d.dtype)
        return out

    def gram(self, module, pieces, attrs):
        facs = [_factors(module, a, d) for a, d in pieces]
        x1, x2, d = (_cat([f[k] for f in facs]) for k in range(3))
        n, t = d.shape[0], d.shape[1]
        D, X1, X2 = d.reshape(n * t, -1), x1.reshape(n * t, -1), x2.reshape(n * t, -1)
        out = []
        for s, e in sample_chunks(n * t * t, n):
            rows = slice(s * t, e * t)
            dd = D[rows] @ D.T
            inner = dd.new_zeros(dd.shape)
            if "weight" in attrs:
                inner = inner + (X1[rows] @ X1.T) * (X2[rows] @ X2.T)
            if "bias" in attrs:
                inner = inner + 1
            out.append((dd * inner).view(e - s, t, n, t).sum((1, 3)))
        return torch.cat(out)

    def gram_materialises(self, module, a, delta):
        return False
