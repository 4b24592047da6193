"""Light capture (:class:`ParamTap`): the hooks of a tracked window whose instruments need only
the window's gradient sum and each micro-step's gradient norm; one hook per parameter, no layer
looked at."""

from __future__ import annotations

from collections import Counter
from typing import Callable

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from gradlens import compat
from gradlens.capture.composed import LossChain
from gradlens.capture.losses import _LOSS_FUNCTIONS, _note_functional_loss
from gradlens.capture.marks import _hints, _input_batch
from gradlens.capture.tracked import declared_batch_dim

__all__ = ["ParamTap"]


class _LossMode(TorchFunctionMode):
    """The only thing a :class:`ParamTap` watches inside a forward: loss functions called there
    (``model(x, labels=y).loss``), reported like an extended loss module."""

    def __init__(self, tap: "ParamTap"):
        super().__init__()
        self.tap = tap

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.tap.chain.marks:  # a loss of this forward taken further (``(ce_a + ce_b) / 2``)
            self.tap.chain.follow(func, args, kwargs, out)
        if func in _LOSS_FUNCTIONS and args and isinstance(args[0], Tensor) and args[0].requires_grad:
            _note_functional_loss(func, kwargs, out, self.tap.batch, args)
        return out


class ParamTap:
    """The hooks of a tracked window whose instruments need no per-sample gradient, only the
    window's gradient sum and each micro-step's gradient norm (``GradNorm``,
    ``NoiseScaleTwoBatch``): no layer is looked at, so every model works as it is, layers
    without a kernel and train-mode BatchNorm included.

    * a forward pre-hook on the model: the micro-batch size (the model's first input, as the
      :class:`~gradlens.capture.tap.Tap` reads it) and a small ``TorchFunctionMode`` that notes loss functions called
      inside the forward;
    * one tensor hook per tracked parameter: ``on_grad(name, grad)`` with the ``dL/dp`` of each
      backward, before it is added to ``p.grad`` (and before DDP all-reduces it).

    Same surface as :class:`~gradlens.capture.tap.Tap` where the Lens reads it (``params``, ``uses``, ``received``,
    ``tainted``, ``forward_id``, ``batch``, ``install``/``remove``/``set_params``/``reset_micro``).
    """

    def __init__(self, model: nn.Module, params: dict[str, nn.Parameter], on_grad: Callable[[str, Tensor], None]):
        self.model = model
        self.on_grad = on_grad
        self._handles: list = []
        self._hint = _hints(model)
        self._mode = _LossMode(self)
        self.chain = LossChain()  # the losses of a forward followed to what it returns
        self._depth = 0
        self.batch: int | None = None
        self.forward_id = 0
        self.set_params(params)
        self.reset_micro()

    def set_params(self, params: dict[str, nn.Parameter]) -> None:
        was = self.installed
        self.remove()
        self.params = dict(params)
        if was:
            self.install()

    MICRO_STATE = ("uses", "received", "tainted")  # (as Tap.MICRO_STATE)

    def reset_micro(self) -> None:
        self.uses: Counter = Counter()
        self.received: set[str] = set()
        self.tainted: dict[str, str] = {}

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def install(self) -> None:
        if self._handles:
            return
        tap = self
        root = self.model
        # k=None: removed by an earlier pre-hook of the same forward, see Tap.install
        self._handles.append(root.register_forward_pre_hook(
            lambda m, a, k=None: None if k is None else tap._pre(m, a, k), with_kwargs=True))
        self._handles.append(root.register_forward_hook(lambda m, a, o: tap._post(o), always_call=True))
        for q, p in self.params.items():
            if p.requires_grad:
                self._handles.append(p.register_hook(self._grad_hook(q)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._depth:
            self.chain.end(None)
        while self._depth:
            self._depth -= 1
            self._mode.__exit__(None, None, None)

    def _grad_hook(self, q: str):
        on_grad = self.on_grad

        def hook(grad: Tensor) -> None:
            on_grad(q, grad)

        return hook

    def _pre(self, module, args, kwargs):
        if not torch.is_grad_enabled() or compat.in_functorch_transform():
            return None
        if self._depth == 0:
            dim = declared_batch_dim(module)
            found = _input_batch(tuple(args) + tuple(kwargs.values()), self._hint.get(id(module), 0) if dim is None else dim)
            if found is not None:
                self.batch = found[1]
            self.forward_id += 1
            self.chain.begin()
            self._mode.__enter__()
        self._depth += 1
        return None

    def _post(self, output=None) -> None:
        if self._depth:
            self._depth -= 1
            if self._depth == 0:
                self._mode.__exit__(None, None, None)
                self.chain.end(output)
