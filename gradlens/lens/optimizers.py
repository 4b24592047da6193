"""Which optimizer a Lens hooks: the torch optimizer behind the object a training framework
hands back (Accelerate's ``AcceleratedOptimizer``; under DeepSpeed, DeepSpeed's optimizer, which
:mod:`gradlens.distributed.deepspeed` resolves), and that framework's GradScaler. Told without
importing the framework (an import of it would make ``import gradlens`` heavy)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from gradlens.distributed.deepspeed import from_deepspeed

__all__ = ["after_closure", "unwrap_optimizer"]


def unwrap_optimizer(optimizer: Any) -> tuple[Any, Any]:
    """``(torch optimizer, GradScaler or None)`` behind ``optimizer``.

    Accelerate's ``AcceleratedOptimizer`` is a ``torch.optim.Optimizer`` subclass that never runs
    ``Optimizer.__init__`` (it has no step hooks) and steps the optimizer it holds
    (``.optimizer``) only on real updates: the Lens hooks that one. Under DeepSpeed, Accelerate's
    ``DeepSpeedOptimizerWrapper`` holds DeepSpeed's optimizer: returned as it is (the Lens then
    finds the torch optimizer inside it, :func:`gradlens.distributed.deepspeed.resolve`). Anything else (a
    :class:`~gradlens.GradientAccumulateOptimizer` too) is returned as it is, with no scaler.
    """
    inner = getattr(optimizer, "optimizer", None)
    if _from_accelerate(optimizer) and from_deepspeed(inner):
        # DeepSpeedOptimizerWrapper (Accelerate / the Trainer under DeepSpeed): DeepSpeed's own
        # optimizer, which the Lens resolves next (gradlens.distributed.deepspeed.resolve)
        return inner, None
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


def after_closure(args: tuple, kwargs: dict, before_update: Callable[[], None]):
    """A step pre-hook's result that runs ``before_update`` just before the optimizer's update:
    now (None: arguments unchanged), or, for ``optimizer.step(closure)`` (PyTorch Lightning),
    once the closure has run this window's last micro-step inside ``step()``: the arguments
    with the closure wrapped. ``args[0]`` is the optimizer (torch passes step's full positional
    arguments)."""
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if not callable(closure):
        before_update()
        return None
    done: list[bool] = []

    def closure_then_snapshot(*a, **k):
        out = closure(*a, **k)
        if not done:
            done.append(True)
            before_update()
        return out

    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure_then_snapshot}
    return (args[0], closure_then_snapshot, *args[2:]), kwargs
