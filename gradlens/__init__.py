"""gradlens: per-sample gradient statistics for PyTorch, exact across gradient accumulation.

Public names are imported lazily (PEP 562), so ``import gradlens`` stays light: it does not
import matplotlib, tqdm or BackPACK until a name that needs them is used.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from importlib.metadata import PackageNotFoundError, version as _version
from typing import Any

try:
    __version__ = _version("gradlens")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0+unknown"

_LAZY = {
    # instruments side
    "extend": "gradlens.capture",
    "Lens": "gradlens.lens.lens",
    "Record": "gradlens.core.records",
    "Hist1d": "gradlens.core.records",
    "Hist2d": "gradlens.core.records",
    "load_log": "gradlens.output.sinks",
    "top_samples": "gradlens.instruments.origin",
    "save_checkpoint": "gradlens.training.checkpoint",
    "load_checkpoint": "gradlens.training.checkpoint",
    "register_kernel": "gradlens.capture.registry",
    "register_forward": "gradlens.capture.registry",
    "supported_layers": "gradlens.capture.registry",
    # training side
    "GradientAccumulateOptimizer": "gradlens.training.accumulate",
    "GradientAccumulateModel": "gradlens.training.accumulate",
    "adaptive_clip_grad": "gradlens.training.agc",
    "adaptive_clip_grad_": "gradlens.training.agc",
    "unitwise_norm": "gradlens.training.agc",
    "compute_norm": "gradlens.training.agc",
    "AccumBatchNorm1d": "gradlens.training.batchnorm",
    "AccumBatchNorm2d": "gradlens.training.batchnorm",
    "AccumBatchNorm3d": "gradlens.training.batchnorm",
    "AccumBatchNormAct2d": "gradlens.training.batchnorm",
    "AccumSyncBatchNorm": "gradlens.training.batchnorm",
    "register_accum_batchnorm": "gradlens.training.batchnorm",
    "convert_accum_batchnorm": "gradlens.training.batchnorm",
    "follow_optimizer": "gradlens.training.batchnorm",
}
_SUBMODULES = {"instruments", "integrations", "capture", "kernels", "measure", "lens", "core", "distributed",
               "training", "output", "cli", "compat"}

#: where the modules of gradlens 0.1 live now (``import gradlens.sinks`` keeps working: the same
#: module object under its old name, see :class:`_MovedModules`)
_MOVED = {
    "gradlens.records": "gradlens.core.records",
    "gradlens.sinks": "gradlens.output.sinks",
    "gradlens.plot": "gradlens.output.plot",
    "gradlens.accumulate": "gradlens.training.accumulate",
    "gradlens.agc": "gradlens.training.agc",
    "gradlens.batchnorm": "gradlens.training.batchnorm",
    "gradlens.checkpoint": "gradlens.training.checkpoint",
    "gradlens.registry": "gradlens.capture.registry",
    "gradlens.fsdp": "gradlens.distributed.fsdp",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES or f"gradlens.{name}" in _MOVED:
        return importlib.import_module(f"gradlens.{name}")
    raise AttributeError(f"module 'gradlens' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | _SUBMODULES)


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds a module of gradlens 0.1 under its old name (:data:`_MOVED`): the import gives the
    module at its new place, the same object (a monkeypatch through either name is seen by both)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        if fullname not in _MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module(_MOVED[spec.name])
        spec.loader_state = module.__spec__  # (the import system sets the old name's spec on it)
        return module

    def exec_module(self, module) -> None:  # the module at its new place has run already
        module.__spec__ = module.__spec__.loader_state


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())
