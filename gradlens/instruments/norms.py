"""Norm-type instruments: per-sample squared norms, sums of squares, the gradient norm.

None of them materialises per-sample gradients of Linear layers (factor identities, see
:mod:`gradlens.kernels`).
"""

from __future__ import annotations

import math

from gradlens.instruments.base import Instrument

from gradlens.core.stats import WindowStats

__all__ = ["BatchL2", "SumGradSquared", "GradNorm"]


class BatchL2(Instrument):
    """``record["batch_l2"]``: Tensor ``[N]`` float64, ||g_n||^2 summed over tracked parameters.

    Samples are in the order the micro-steps saw them; micro-steps concatenate.
    """

    key = "batch_l2"
    needs = frozenset({"batch_l2"})
    per_group = True

    def finalize(self, stats: WindowStats, state):
        return stats.batch_l2_all().double().cpu()


class SumGradSquared(Instrument):
    """``record["sum_grad_squared"]``: dict parameter name -> ``[*param]`` (CPU, in the
    accumulation dtype: float32 or wider), sum_n g_n * g_n over the window's N samples
    (micro-steps add)."""

    key = "sum_grad_squared"
    needs = frozenset({"sum_grad_squared"})
    per_group = True

    def finalize(self, stats: WindowStats, state):
        return {k: v.detach().cpu() for k, v in stats.sum_grad_squared.items()}


class GradNorm(Instrument):
    """``record["grad_norm"]``: float, ||g|| for the window gradient g = (1/N) sum_n g_n under a
    mean loss, sum_n g_n under a sum loss (micro-steps add sum_n g_n; N is the window's)."""

    key = "grad_norm"
    needs = frozenset({"grad_sum"})
    per_group = True

    def finalize(self, stats: WindowStats, state):
        return math.sqrt(float(stats.window_grad_sq_norm()))
