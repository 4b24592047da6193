"""The inner-product and orthogonality tests (:class:`InnerTest`, :class:`OrthoTest`) and the
projections ``g_n . G`` onto the window's mean gradient G that they share."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from gradlens.core.stats import WindowStats
from gradlens.instruments.crosssample import _CrossSample, _DotState, _memo, _memo_layer_gram, _pieces_key

__all__ = ["InnerTest", "OrthoTest"]


def _mean_projections(inst: _CrossSample, stats: WindowStats, state: _DotState) -> tuple[Tensor, float]:
    """Memoised :func:`_mean_projections_uncached` (exact mode: shared by InnerTest/OrthoTest;
    sketch mode: each instrument has its own sketch)."""
    if inst.mode == "sketch":
        return _mean_projections_uncached(inst, stats, state)
    memo = _memo(stats)
    key = ("mean_proj",) + tuple((nm, _pieces_key(pc)) for nm, pc, _ in inst._layer_pieces(state))
    if key not in memo:
        memo[key] = _mean_projections_uncached(inst, stats, state)
    return memo[key]


def _mean_projections_uncached(
    inst: _CrossSample, stats: WindowStats, state: _DotState
) -> tuple[Tensor, float]:
    """``([N] g_n . G, ||G||^2)`` for G = (1/N) sum_n g_n, the window's mean per-sample gradient.

    Exact mode, per layer, whichever is cheaper: the Gram route ``g_n . G = (1/N) sum_m
    K_nm`` (plain Linear layers with ``N (d_in + d_out) < d_in d_out``; then
    ``||G_l||^2 = sum_nm K_nm / N^2``), or the layer's G_l from its factors (the kernel's
    ``grad_sum`` over the window) and a forward along G_l. Sketch mode: ``s_n . mean_m s_m``
    (unbiased) and the exact ``||G||^2`` of the capture's ``grad_sum``.
    """
    n = state.num_samples
    if inst.mode == "sketch":
        S = inst._sketches(state)
        return S @ S.mean(0), float(stats.mean_grad_sq_norm())
    inst._check_versions(state)
    proj = torch.zeros(n, dtype=torch.float64)
    g2 = 0.0
    for name, pieces, idx in inst._layer_pieces(state):
        w, a0, d0 = pieces[0]
        if w.kernel.mean_via_gram(w.module, a0, d0, n):
            k = _memo_layer_gram(stats, pieces)
            p = k.sum(1) / n
            g2 += float(k.sum()) / (n * n)
        else:
            same = all(pc[1].shape[1:] == a0.shape[1:] for pc in pieces)
            same = same and not w.kernel.per_micro_batch
            if same and a0.is_floating_point():
                groups = [(torch.cat([pc[1] for pc in pieces]), torch.cat([pc[2] for pc in pieces]))]
            else:
                groups = [(pc[1], pc[2]) for pc in pieces]
            G: dict[str, Tensor] = {}
            for a, d in groups:
                for attr, v in w.kernel.grad_sum(w.module, a, d).items():
                    if attr in w.params:
                        G[attr] = G[attr] + v if attr in G else v
            G = {attr: v / n for attr, v in G.items()}
            g2 += float(sum(torch.sum(v.double().square()) for v in G.values()))
            p = torch.cat([w.kernel.directional(w.module, a, d, G, w.params) for a, d in groups])
            p = p.double().cpu()
        if idx is None:
            proj += p.cpu()
        else:
            proj[idx] += p.cpu()
    return proj, g2


class _MeanTest(_CrossSample):
    @property
    def per_group(self) -> bool:
        """Per group in exact mode: the test of the group's g_n (G and g_n . G over its
        parameters); a sketch is of the whole g_n only."""
        return self.mode == "exact"

    def __init__(self, mode: str = "exact", **kwargs):
        super().__init__(mode, **kwargs)
        if mode == "sketch":  # the exact ||G||^2 comes from the capture's grad_sum
            self.needs = type(self).needs | {"grad_sum"}


class InnerTest(_MeanTest):
    """``record["inner_test"]``: float, the inner-product test of Bollapragada, Byrd & Nocedal
    (2018, eq. 2.6) as in Cockpit — the smallest theta for which it passes this window:

        inner_test = sqrt( Var_n(g_n . G) / N ) / ||G||^2,

    with G = (1/N) sum_n g_n the window's mean per-sample gradient (also under a "sum" loss: the
    test is about the mean), ``Var_n`` the unbiased sample variance over the N samples of all
    micro-steps. ``g_n . G`` couples samples of different micro-steps, so the window keeps the
    layer factors (exact) or sketches (sketch: ``g_n . G`` estimated by ``s_n . mean_m s_m``,
    unbiased; ``||G||^2`` exact; the test value itself is then approximate). NaN if N < 2 or
    G = 0.
    """

    key = "inner_test"
    needs = frozenset({"layer"})

    def finalize(self, stats: WindowStats, state: _DotState) -> float:
        n = stats.num_samples
        if n < 2:
            return math.nan
        p, g2 = _mean_projections(self, stats, state)
        return math.sqrt(float(p.var()) / n) / g2 if g2 > 0 else math.nan


class OrthoTest(_MeanTest):
    """``record["ortho_test"]``: float, the orthogonality test of Bollapragada, Byrd & Nocedal
    (2018, eq. 3.3) as in Cockpit — the smallest nu for which it passes this window:

        ortho_test = sqrt( V / (N ||G||^2) ),
        V = 1/(N-1) sum_n || g_n - (g_n . G / ||G||^2) G ||^2
          = 1/(N-1) ( sum_n ||g_n||^2 - sum_n (g_n . G)^2 / ||G||^2 ),

    with G = (1/N) sum_n g_n the window's mean per-sample gradient. ``||g_n||^2`` comes from the
    capture (``batch_l2``, factor identities) and ``||G||^2`` is exact; ``g_n . G`` as in
    :class:`InnerTest` (exact or sketched). NaN if N < 2 or G = 0.
    """

    key = "ortho_test"
    needs = frozenset({"layer", "batch_l2"})

    def finalize(self, stats: WindowStats, state: _DotState) -> float:
        n = stats.num_samples
        if n < 2:
            return math.nan
        p, g2 = _mean_projections(self, stats, state)
        if g2 <= 0:
            return math.nan
        v = (float(stats.batch_l2_all().double().sum()) - float(p.square().sum()) / g2) / (n - 1)
        return math.sqrt(max(v, 0.0) / (n * g2))
