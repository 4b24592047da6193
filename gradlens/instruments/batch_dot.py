"""BatchDot: the window's Gram matrix ``g_n . g_m`` across micro-steps (exact and sketch modes:
see :mod:`gradlens.instruments.crosssample`)."""

from __future__ import annotations

from torch import Tensor

from gradlens.core.stats import WindowStats
from gradlens.instruments.crosssample import _CrossSample, _DotState

__all__ = ["BatchDot"]


class BatchDot(_CrossSample):
    """``record["batch_dot"]``: Tensor ``[N, N]`` float64, ``g_n . g_m`` over the tracked
    parameters for every pair of samples of the window (rows in the order the samples were seen;
    micro-steps concatenate, cross-micro-step blocks included).

    Exact mode keeps each layer's input and output gradient for the window (bounded by
    ``max_bytes``) and forms the Gram from the factor identities at window end. Sketch mode keeps
    ``[N, k]`` sketches; each entry is then unbiased with standard deviation at most
    ``sqrt(8 / k) ||g_n|| ||g_m||``. ``record.meta["batch_dot"]`` is ``"exact"`` or
    ``"sketch(k=...)"``.

    Args:
        mode: ``"exact"`` (default) or ``"sketch"``.
        k: sketch dimension (sketch mode).
        max_bytes: memory budget, bytes kept for the window (default 1 GiB): exact mode's
            factors, sketch mode's random matrices and ``[N, k]`` sketches; exceeding it raises
            an error with the estimate.
        seed: seed of the sketch.
    """

    key = "batch_dot"
    gram_in_backward = True

    @property
    def carries_scale(self) -> bool:
        """Exact mode keeps output gradients unscaled with their micro-step's scale: its Grams
        are bilinear in them (see :class:`~gradlens.instruments.crosssample._Layer`)."""
        return self.mode == "exact"

    @property
    def per_group(self) -> bool:
        """Per group in exact mode (each group's Gram from its layers' factors); a sketch is of
        the whole g_n only."""
        return self.mode == "exact"

    def _materialises(self, module, a, delta):
        return module.kernel.gram_materialises(module.module, a, delta)

    def finalize(self, stats: WindowStats, state: _DotState) -> Tensor:
        return self._gram(state, stats)
