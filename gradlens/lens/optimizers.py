"""Which optimizer a Lens hooks: the torch optimizer behind the object a training framework
hands back (Accelerate's ``AcceleratedOptimizer``), and that framework's GradScaler. Told without
importing the framework (an import of it would make ``import gradlens`` heavy)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["unwrap_optimizer"]


def unwrap_optimizer(optimizer: Any) -> tuple[Any, Any]:
    """``(torch optimizer, GradScaler or None)`` behind ``optimizer``.

    Accelerate's ``AcceleratedOptimizer`` is a ``torch.optim.Optimizer`` subclass that never runs
    ``Optimizer.__init__`` (it has no step hooks) and steps the optimizer it holds
    (``.optimizer``) only on real updates: the Lens hooks that one. Anything else (a
    :class:`~gradlens.GradientAccumulateOptimizer` too) is returned as it is, with no scaler.
    """
    inner = getattr(optimizer, "optimizer", None)
    if _from_accelerate(optimizer) and isinstance(inner, torch.optim.Optimizer):
        inner, scaler = unwrap_optimizer(inner)  # nested wrappers
        if scaler is None:
            scaler = getattr(optimizer, "scaler", None)
            if scaler is not None and not callable(getattr(scaler, "get_scale", None)):
                scaler = None
            enabled = getattr(scaler, "is_enabled", None)
            if scaler is not None and callable(enabled) and not enabled():
                scaler = None
        return inner, scaler
    return optimizer, None


def _from_accelerate(obj: Any) -> bool:
    """An instance of a class defined in the ``accelerate`` package (or a subclass of one),
    told without importing it."""
    return any(c.__module__.split(".")[0] == "accelerate" for c in type(obj).__mro__)
