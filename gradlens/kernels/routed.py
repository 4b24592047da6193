"""Routed experts in factored form: a 3-D parameter ``W [E, p1, p2]`` whose slice ``W[e]`` meets
only the tokens routed to expert e (a mixture-of-experts block: the eager loop's
``F.linear(x, w[e])``, ``grouped_mm`` with offsets). Sample n's gradient of slice e is the
segment sum over its tokens routed there, ``G_{n,e} = sum_{t in (n, e)} u_t v_t^T``
(``u [p1]``, ``v [p2]``: the output gradient and input of ``F.linear``; for a weight stored
``[E, in, out]`` the input and output gradient), so every quantity comes from the tokens'
factors without the ``[B, E, p1, p2]`` per-sample gradients:

- ``||G_n||^2 = sum_e sum_{t, t' in (n, e)} (u_t . u_t')(v_t . v_t')`` (token pairs of one
  sample and one expert), or from the non-empty segments materialised a few at a time where
  that costs less (many tokens per sample);
- ``<G_n, G_m> = sum_e sum_{t in (n, e), t' in (m, e)} (u_t . u_t')(v_t . v_t')``;
- ``sum_n G_n = sum_e sum_{t to e} u_t v_t^T`` (one product per expert);
- ``sum_n G_n^2``: the non-empty ``(n, e)`` segments formed a few at a time (``index_add`` of
  the tokens' outer products), squared and added into their expert's slice;
- ``<D, G_n> = sum_t u_t^T D_{e_t} v_t``.

The kernel's ``a`` and ``delta`` are batch-first packings of the tokens (:func:`pack`):
``delta [B, P, p1]`` (the u), ``a [B, P, p2 + 1]`` (the v, then the token's expert as a
number; -1 and zeros for padding), so pieces of several micro-steps carry their own routing."""

from __future__ import annotations

import torch
from torch import Tensor

from gradlens.core.limits import CHUNK_ELEMENTS, CPU_SLICE_ELEMENTS
from gradlens.kernels.base import Kernel

__all__ = ["Routed", "RoutedKernel", "pack"]


class Routed:
    """A routed expert parameter (``attr`` -> ``[E, p1, p2]``) in place of a module:
    :class:`RoutedKernel` reads the tokens' factors from its ``a`` and ``delta``."""

    def __init__(self, attr: str, param: Tensor):
        setattr(self, attr, param)
        self._attr = attr
        self.experts = param.shape[0]

    def named_parameters(self, recurse: bool = False):
        return [(self._attr, getattr(self, self._attr))]

    def parameters(self, recurse: bool = False):
        return [getattr(self, self._attr)]


def pack(owner: Tensor, expert: Tensor, u: Tensor, v: Tensor, batch: int) -> tuple[Tensor, Tensor]:
    """``(a [B, P, p2 + 1], delta [B, P, p1])`` from ``M`` routed tokens: ``owner [M]`` (their
    samples), ``expert [M]``, ``u [M, p1]``, ``v [M, p2]``; P the most tokens of one sample,
    each sample's tokens sorted by expert, padding rows of expert -1 and zeros."""
    e_max = int(expert.max()) + 1 if expert.numel() else 1
    order = torch.argsort(owner * e_max + expert, stable=True)
    owner, expert, u, v = owner[order], expert[order], u[order], v[order]
    counts = torch.bincount(owner, minlength=batch)
    p = max(1, int(counts.max())) if owner.numel() else 1
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(owner.numel(), device=owner.device) - starts[owner]
    a = v.new_zeros(batch, p, v.shape[1] + 1)
    a[..., -1] = -1
    delta = u.new_zeros(batch, p, u.shape[1])
    a[owner, slot, :-1] = v
    a[owner, slot, -1] = expert.to(v.dtype)
    delta[owner, slot] = u
    return a, delta


def _tokens(a: Tensor, delta: Tensor, offset: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(owner [M], expert [M], u [M, p1], v [M, p2])`` of the packing's real tokens
    (samples numbered from ``offset``)."""
    ids = a[..., -1].long()
    keep = ids >= 0
    owner = torch.arange(a.shape[0], device=a.device)[:, None].expand(ids.shape)[keep] + offset
    return owner, ids[keep], delta[keep], a[..., :-1][keep]


def _budget(t: Tensor) -> int:
    """Elements of one block of formed segments or outer products: :data:`CHUNK_ELEMENTS`, on
    the CPU :data:`CPU_SLICE_ELEMENTS` (as the materialising pass of
    :mod:`gradlens.measure.slices`)."""
    return CPU_SLICE_ELEMENTS if t.device.type == "cpu" else CHUNK_ELEMENTS


def _add_outer(out: Tensor, index: Tensor, u: Tensor, v: Tensor) -> None:
    """``out[index[t]] += u_t v_t^T`` for every token t, a bounded number of outer products
    (at most :func:`_budget` elements) at a time."""
    p1, p2 = u.shape[1], v.shape[1]
    step = max(1, _budget(u) // max(1, p1 * p2))
    for s in range(0, u.shape[0], step):
        e = min(u.shape[0], s + step)
        out.index_add_(0, index[s:e], u[s:e, :, None] * v[s:e, None, :])


def _segments(a: Tensor, delta: Tensor, experts: int):
    """The non-empty ``(sample, expert)`` segments, a few at a time: yields ``(sample [S],
    expert [S], G [S, p1, p2])`` with ``S p1 p2`` at most :func:`_budget` (at least one)."""
    owner, ids, u, v = _tokens(a, delta)
    seg = owner * experts + ids
    seg, order = torch.sort(seg, stable=True)
    u, v = u[order], v[order]
    useg, inv, counts = torch.unique_consecutive(seg, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).tolist()
    step = max(1, _budget(u) // max(1, u.shape[1] * v.shape[1]))
    for j0 in range(0, useg.numel(), step):
        j1 = min(useg.numel(), j0 + step)
        t0, t1 = (ends[j0 - 1] if j0 else 0), ends[j1 - 1]
        g = u.new_zeros(j1 - j0, u.shape[1], v.shape[1])
        _add_outer(g, inv[t0:t1] - j0, u[t0:t1], v[t0:t1])
        yield useg[j0:j1] // experts, useg[j0:j1] % experts, g


class RoutedKernel(Kernel):
    """Kernel of a :class:`Routed` parameter (``a``, ``delta``: the tokens packed by
    :func:`pack`): norms, Grams, sums and directions from the tokens' factors and segment
    sums; materialised slices (histograms, sketches) ``[b, E, p1, p2]`` for a few samples at a
    time, as every kernel's."""

    factored = True

    @staticmethod
    def _pairs_cheaper(a: Tensor, delta: Tensor) -> bool:
        """Whether sample n's norm costs less from its token pairs, ``P^2 (p1 + p2)``, than from
        its segments formed, ``P p1 p2``."""
        p, p1, p2 = delta.shape[1], delta.shape[2], a.shape[2] - 1
        return p * (p1 + p2) <= p1 * p2

    def per_sample(self, module, a, delta, start, stop, attrs=None):
        e = module.experts
        ids = a[start:stop, :, -1].long()
        keep = ids >= 0
        owner = torch.arange(stop - start, device=a.device)[:, None].expand(ids.shape)[keep]
        out = delta.new_zeros((stop - start) * e, delta.shape[2], a.shape[2] - 1)
        _add_outer(out, owner * e + ids[keep], delta[start:stop][keep], a[start:stop, :, :-1][keep])
        return {module._attr: out.view(stop - start, e, delta.shape[2], a.shape[2] - 1)}

    def batch_l2(self, module, a, delta):
        b, p = delta.shape[0], delta.shape[1]
        if not self._pairs_cheaper(a, delta):
            out = delta.new_zeros(b)
            for n, _, g in _segments(a, delta, module.experts):
                out.index_add_(0, n, g.square_().sum((1, 2)))
            return {module._attr: out}
        ids, v = a[..., -1], a[..., :-1]
        parts = []
        step = max(1, CHUNK_ELEMENTS // max(1, p * p))
        for s in range(0, b, step):
            e = min(b, s + step)
            same = ids[s:e, :, None] == ids[s:e, None, :]
            kd = torch.bmm(delta[s:e], delta[s:e].transpose(1, 2))
            kv = torch.bmm(v[s:e], v[s:e].transpose(1, 2))
            parts.append((kd * kv * same).sum((1, 2)))
        return {module._attr: torch.cat(parts)}

    def sum_grad_squared(self, module, a, delta):
        param = getattr(module, module._attr)
        out = delta.new_zeros(module.experts, delta.shape[2], a.shape[2] - 1)
        for _, ex, g in _segments(a, delta, module.experts):
            out.index_add_(0, ex, g.square_())
        return {module._attr: out.view(param.shape)}

    def grad_sum(self, module, a, delta):
        _, ids, u, v = _tokens(a, delta)
        out = delta.new_zeros(module.experts, u.shape[1], v.shape[1])
        ids, order = torch.sort(ids, stable=True)
        u, v = u[order], v[order]
        counts = torch.bincount(ids, minlength=module.experts).tolist()
        s = 0
        for e, c in enumerate(counts):
            if c:
                out[e] = u[s:s + c].T @ v[s:s + c]
                s += c
        return {module._attr: out}

    def directional(self, module, a, delta, direction, attrs):
        """``[B]``: ``<D, G_n> = sum_t u_t^T D_{e_t} v_t``, one product per expert."""
        owner, ids, u, v = _tokens(a, delta)
        d = direction[module._attr].to(delta.dtype)
        out = delta.new_zeros(delta.shape[0])
        for e in torch.unique(ids).tolist():
            m = ids == e
            out.index_add_(0, owner[m], ((u[m] @ d[e]) * v[m]).sum(1))
        return out

    def gram(self, module, pieces, attrs):
        """``[n, n]``: ``<G_n, G_m>`` from the token pairs of each expert (pieces: the
        micro-steps' packings, samples numbered in order), ``R_e x R_e`` products a block of
        rows at a time: no ``[n, E p1 p2]``."""
        toks, off = [], 0
        for a, d in pieces:
            toks.append(_tokens(a, d, off))
            off += d.shape[0]
        owner, ids, u, v = (torch.cat([t[i] for t in toks]) for i in range(4))
        n = off
        out = u.new_zeros(n, n)
        for e in torch.unique(ids).tolist():
            m = ids == e
            oe, ue, ve = owner[m], u[m], v[m]
            step = max(1, CHUNK_ELEMENTS // max(1, oe.numel() + n))
            for s in range(0, oe.numel(), step):
                pair = (ue[s:s + step] @ ue.T) * (ve[s:s + step] @ ve.T)
                rows = pair.new_zeros(pair.shape[0], n).index_add_(1, oe, pair)
                out.index_add_(0, oe[s:s + step], rows)
        return out

    def gram_materialises(self, module, a, delta):
        return False
