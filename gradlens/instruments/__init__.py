"""Instruments: what gradlens measures. Each sets a record key (``record[key]``)."""

from gradlens.instruments.base import Instrument, WindowStats
from gradlens.instruments.dots import Alpha, BatchDot, InnerTest, OrthoTest
from gradlens.instruments.hist import GradHist1d, GradHist2d
from gradlens.instruments.noise import NoiseScaleMonitor, NoiseScaleTwoBatch
from gradlens.instruments.norms import BatchL2, GradNorm, SumGradSquared
from gradlens.instruments.tests import MeanGSNR, NoiseScale, NormTest

__all__ = [
    "Instrument",
    "WindowStats",
    "BatchL2",
    "SumGradSquared",
    "GradNorm",
    "GradHist1d",
    "GradHist2d",
    "NormTest",
    "MeanGSNR",
    "NoiseScale",
    "NoiseScaleTwoBatch",
    "NoiseScaleMonitor",
    "BatchDot",
    "Alpha",
    "InnerTest",
    "OrthoTest",
]
