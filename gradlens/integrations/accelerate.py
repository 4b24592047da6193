"""Hugging Face Accelerate: a :class:`~gradlens.Lens` on the optimizer that
``accelerator.prepare`` returns.

Nothing to install beyond Accelerate itself, and this module does not import it: the
:class:`~gradlens.Lens` calls :func:`~gradlens.lens.optimizers.unwrap_optimizer` on every ``optimizer=`` it is given. Recipe
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

from gradlens.lens.optimizers import unwrap_optimizer

__all__ = ["unwrap_optimizer"]
