"""gradlens: per-sample gradient statistics for PyTorch, exact across gradient accumulation.

Public names are imported lazily (PEP 562), so ``import gradlens`` stays light: it does not
import matplotlib, tqdm or BackPACK until a name that needs them is used.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version as _version
from typing import Any

try:
    __version__ = _version("gradlens")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0+unknown"

_LAZY = {
    # instruments side
    "extend": "gradlens.capture",
    "Lens": "gradlens.lens",
    "Record": "gradlens.records",
    "Hist1d": "gradlens.records",
    "Hist2d": "gradlens.records",
    "load_log": "gradlens.sinks",
    "save_checkpoint": "gradlens.checkpoint",
    "load_checkpoint": "gradlens.checkpoint",
    "register_kernel": "gradlens.registry",
    "register_forward": "gradlens.registry",
    "supported_layers": "gradlens.registry",
    # training side
    "GradientAccumulateOptimizer": "gradlens.accumulate",
    "GradientAccumulateModel": "gradlens.accumulate",
    "adaptive_clip_grad": "gradlens.agc",
    "adaptive_clip_grad_": "gradlens.agc",
    "unitwise_norm": "gradlens.agc",
    "compute_norm": "gradlens.agc",
    "AccumBatchNorm1d": "gradlens.batchnorm",
    "AccumBatchNorm2d": "gradlens.batchnorm",
    "AccumBatchNorm3d": "gradlens.batchnorm",
    "convert_accum_batchnorm": "gradlens.batchnorm",
    "follow_optimizer": "gradlens.batchnorm",
}
_SUBMODULES = {"instruments", "plot", "cli", "records", "sinks", "checkpoint", "capture", "lens", "registry", "kernels", "ops"}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"gradlens.{name}")
    raise AttributeError(f"module 'gradlens' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | _SUBMODULES)
