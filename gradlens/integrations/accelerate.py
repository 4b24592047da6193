"""Hugging Face Accelerate: a :class:`~gradlens.Lens` on the optimizer that
``accelerator.prepare`` returns.

Nothing to install beyond Accelerate itself, and this module does not import it: the
:class:`~gradlens.Lens` calls :func:`unwrap_optimizer` on every ``optimizer=`` it is given. Recipe
(the one ``tests/test_integrations_accelerate.py`` runs)::

    accelerator = Accelerator(gradient_accumulation_steps=3)
    model = gradlens.extend(model)
    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    lens = Lens(model, [BatchL2(), GradNorm(), GradHist1d()], optimizer=optimizer)
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = loss_fn(model(x), y)
            with lens.capture():
                accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()

A window is one real update: the prepared optimizer's ``step()`` does nothing on Accelerate's
non-sync micro-steps (``accelerator.sync_gradients`` False), so only the sync step closes the
window (the last, shorter window of an epoch included); the ``1/K`` that ``accelerator.backward``
applies is measured and divided out by the extended loss module (units of docs/design.md: the
micro-step's loss is a mean over its ``B_k`` samples, ``g_n = B_k * grad L_n``). Under mixed
precision the prepared optimizer's ``GradScaler`` becomes the Lens' ``grad_scaler``, so a step
it skips (inf/nan, ``optimizer.step_was_skipped``) drops its window instead of merging it into
the next.
"""

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
