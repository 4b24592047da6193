"""Instruments: what gradlens measures. Each sets a record key (``record[key]``)."""

from gradlens.instruments.base import Instrument

from gradlens.core.stats import WindowStats
from gradlens.instruments.accumulation import AccumulationCheck
from gradlens.instruments.alpha import Alpha
from gradlens.instruments.batch_dot import BatchDot
from gradlens.instruments.criteria import CABS, EarlyStopping
from gradlens.instruments.curvature import HessMaxEV, HessTrace, TICDiag, TICTrace, configuration
from gradlens.instruments.hist import GradHist1d
from gradlens.instruments.hist2d import GradHist2d
from gradlens.instruments.mean_tests import InnerTest, OrthoTest
from gradlens.instruments.noise import NoiseScaleDDP, NoiseScaleMonitor, NoiseScaleTwoBatch
from gradlens.instruments.norms import BatchL2, GradNorm, SumGradSquared
from gradlens.instruments.origin import SampleOrigin, sample_origins, top_samples
from gradlens.instruments.tests import MeanGSNR, NoiseScale, NormTest
from gradlens.instruments.trajectory import Distance, UpdateSize

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
    "NoiseScaleDDP",
    "BatchDot",
    "Alpha",
    "InnerTest",
    "OrthoTest",
    "Distance",
    "UpdateSize",
    "AccumulationCheck",
    "CABS",
    "EarlyStopping",
    "HessMaxEV",
    "HessTrace",
    "TICDiag",
    "TICTrace",
    "configuration",
    "SampleOrigin",
    "sample_origins",
    "top_samples",
]
