"""Derived statistics of the window's per-sample gradients: norm test, mean GSNR, noise scale.

Notation: N samples, per-sample gradients g_n, sample mean G = (1/N) sum_n g_n, over all tracked
parameters. All three are scale-free in the loss reduction (they use per-sample units).
"""

from __future__ import annotations

import math


from gradlens.instruments.base import Instrument, WindowStats

__all__ = ["NormTest", "MeanGSNR", "NoiseScale"]


def _trace_cov(stats: WindowStats) -> tuple[float, float]:
    """(tr(Sigma) unbiased, ||G||^2): tr(Sigma) = (sum_n ||g_n||^2 - N ||G||^2) / (N - 1)."""
    n = stats.num_samples
    g2 = float(stats.mean_grad_sq_norm())
    if n < 2:
        return math.nan, g2
    memo = stats.__dict__.setdefault("_memo", {})
    if "l2_total" not in memo:
        memo["l2_total"] = float(stats.batch_l2_all().double().sum())
    return (memo["l2_total"] - n * g2) / (n - 1), g2


class NormTest(Instrument):
    """``record["norm_test"]``: the smallest theta for which the norm test of Byrd et al. (2012)
    / Bollapragada et al. (2018) holds for this window:

        theta = sqrt( tr(Sigma) / N ) / ||G||,   tr(Sigma) = (sum_n ||g_n||^2 - N ||G||^2) / (N - 1)

    (the estimated standard deviation of the mean gradient relative to its norm). NaN if N < 2.
    """

    key = "norm_test"
    needs = frozenset({"batch_l2", "grad_sum"})

    def finalize(self, stats: WindowStats, state):
        tr, g2 = _trace_cov(stats)
        return math.sqrt(max(tr, 0.0) / stats.num_samples) / math.sqrt(g2) if g2 > 0 else math.nan


class NoiseScale(Instrument):
    """``record["noise_scale"]``: the simple gradient noise scale of McCandlish et al. (2018),

        B_simple = tr(Sigma) / ||G||^2,   tr(Sigma) = (sum_n ||g_n||^2 - N ||G||^2) / (N - 1)

    with tr(Sigma) the unbiased estimate from the per-sample norms and ||G||^2 the squared norm of
    the window's mean gradient. NaN if N < 2 or G = 0.
    """

    key = "noise_scale"
    needs = frozenset({"batch_l2", "grad_sum"})

    def finalize(self, stats: WindowStats, state):
        tr, g2 = _trace_cov(stats)
        return tr / g2 if g2 > 0 else math.nan


class MeanGSNR(Instrument):
    """``record["mean_gsnr"]``: the mean gradient signal-to-noise ratio (Liu et al. 2020),

        GSNR_j = G_j^2 / var_j,   var_j = (sum_n g_nj^2 - N G_j^2) / (N - 1),

    averaged over the tracked coordinates j with var_j > 0 (coordinates whose per-sample
    gradients are all equal carry no noise and are left out). NaN if N < 2.
    """

    key = "mean_gsnr"
    needs = frozenset({"sum_grad_squared", "grad_sum"})

    def finalize(self, stats: WindowStats, state):
        n = stats.num_samples
        if n < 2:
            return math.nan
        total, count = 0.0, 0
        for name, s in stats.grad_sum.items():
            mean = s.double() / n
            var = (stats.sum_grad_squared[name].double() - n * mean.square()) / (n - 1)
            ok = var > 0
            total += float((mean[ok].square() / var[ok]).sum())
            count += int(ok.sum())
        return total / count if count else math.nan
