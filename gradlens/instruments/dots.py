"""Compatibility module: the cross-micro-step instruments live in
:mod:`gradlens.instruments.crosssample` (shared machinery), :mod:`~gradlens.instruments.batch_dot`,
:mod:`~gradlens.instruments.mean_tests` and :mod:`~gradlens.instruments.alpha`; their per-layer
maths in :mod:`gradlens.kernels`."""

from gradlens.instruments.alpha import Alpha, alpha_fit
from gradlens.instruments.batch_dot import BatchDot
from gradlens.instruments.crosssample import DEFAULT_MAX_BYTES, _Sketcher
from gradlens.instruments.mean_tests import InnerTest, OrthoTest

__all__ = ["BatchDot", "Alpha", "InnerTest", "OrthoTest", "DEFAULT_MAX_BYTES", "alpha_fit", "_Sketcher"]
