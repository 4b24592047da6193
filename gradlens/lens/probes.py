"""The forward pre-hooks a Lens puts on its model for tracked windows: one notes a compiled
forward (:meth:`gradlens.lens.compiled.CompileNotice.probe`); under torch.distributed one notes the
DDP module that runs the forward (:class:`gradlens.distributed.merge.DDPGradRoute`); the one-shot
probe of a window's first forward that re-reads which parameters are trainable."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from gradlens import compat
from gradlens.distributed.merge import DDPGradRoute
from gradlens.lens.compiled import CompileNotice

__all__ = ["ForwardProbes"]


class ForwardProbes:
    """Forward pre-hooks of tracked windows on the model: one notes a compiled forward
    (:meth:`gradlens.lens.compiled.CompileNotice.probe`); under torch.distributed one notes the DDP
    module that runs the forward (see :class:`gradlens.distributed.merge.DDPGradRoute`); the one-shot
    :func:`_params_probe` of a window (:meth:`arm`). ``install()`` / ``remove()`` (all three) and
    ``disarm()`` are idempotent."""

    def __init__(self, model: nn.Module, notice: CompileNotice, route: DDPGradRoute | None):
        self.model, self.route, self.handles = model, route, []
        self.refresh = None  # the handle of the window's _params_probe, while armed
        self.probes = [notice.probe()]
        if route is not None:
            self.probes.append(lambda module, args: route.on_forward())

    def install(self) -> None:
        if not self.handles:
            self.handles = [self.model.register_forward_pre_hook(p) for p in self.probes]

    def arm(self, lens: Any) -> None:
        """A tracked window opens in the optimizer's step post-hook, before the training loop
        can freeze or unfreeze a parameter: its first forward with gradients refreshes the
        tracked parameters again (registered first, so that the Tap's hooks of that forward see
        the new set)."""
        if self.refresh is None:
            self.refresh = self.model.register_forward_pre_hook(_params_probe(lens), prepend=True, with_kwargs=True)

    def disarm(self) -> None:
        if self.refresh is not None:
            self.refresh.remove()
            self.refresh = None

    def remove(self, route: Any = None) -> None:
        """Remove the hooks (and, given one, the compiled route's: ``route.remove()``)."""
        if route is not None:
            route.remove()
        for h in self.handles:
            h.remove()
        self.handles = []
        self.disarm()


def _params_probe(lens: Any):
    """A one-shot forward pre-hook of a tracked window: at the window's first forward with
    gradients, before anything of it is measured, re-read which parameters are trainable (a
    freeze or unfreeze made after the optimizer's step opened the window counts from it)."""
    ref = weakref.ref(lens)

    def probe(module, args, kwargs) -> None:
        owner = ref()
        if owner is None or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return
        owner._probes.disarm()
        window = owner._window
        if window is not None and not window.micro_steps and owner._meter.micro is None:
            before = compat.pre_hook_ids(module)
            window.coverage = owner._refresh_params()
            # hooks the Tap reinstalled on the model: torch runs this forward's hooks as they
            # were when it started (the removed ones do nothing then), so the new ones run here
            compat.run_pre_hooks_added(module, before, args, kwargs)

    return probe
