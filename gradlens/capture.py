"""Capture: which modules are watched, and how one micro-step's backward reaches the instruments.

``extend(model)`` checks a model once and marks it; ``extend(loss_fn)`` makes a loss module
report its reduction and batch size. A :class:`Tap` installs forward hooks on the watched
modules *only while a tracked window is open* (so untracked steps cost what a plain step
costs). Each forward with grad enabled registers a hook on the module's output; during
``backward`` that hook receives dL/d(output), rescales it to per-sample units (times B under
reduction ``"mean"``) and hands ``(module, input, delta)`` to the Lens.

Why not BackPACK's own module hooks: ``backpack.extend`` installs full backward hooks that stay
on the model and cost ~1.6x a plain step on a 784-512-512-10 MLP even outside a ``backpack``
context. gradlens uses BackPACK's derivatives (see :mod:`gradlens.kernels`) but attaches its own
light hooks for tracked windows only.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import Tensor, nn

from gradlens.kernels import Kernel, kernel_for

__all__ = ["extend", "LossCall", "last_loss_call", "Tap", "WatchedModule", "watched_modules"]

_EXTENDED = "_gradlens_extended"
_EXCLUDE = "_gradlens_exclude"
_LOSS_HOOK = "_gradlens_loss_hook"

_loss_calls = threading.local()


@dataclass
class LossCall:
    """What an extended loss module saw in its last forward pass (in this thread)."""

    reduction: str
    batch_size: int
    output: Tensor  # the loss (0-d), as the user will backpropagate it
    target: tuple[Tensor, int] | None = None  # (class targets, ignore_index) of a mean CE/NLL
    module_name: str = ""
    #: d(backpropagated objective)/d(loss), seen by a hook on the loss output during backward:
    #: 1 for loss.backward(), S under GradScaler, 1/K for "divide the loss by K" recipes.
    multiplier: Tensor | None = None

    @property
    def value(self) -> Tensor:
        return self.output.detach()

    def watch_multiplier(self) -> None:
        """Hook the loss output so that backward reports what multiplied the loss (called by a
        tracked capture only: untracked steps pay nothing)."""
        if self.output.requires_grad:
            # The hook lives on the loss's autograd node; a bound method (or any closure over
            # this LossCall, which holds the loss) would be a reference cycle through C++
            # autograd objects that the collector cannot free: every graph would stay alive.
            # A weak reference breaks it.
            ref = weakref.ref(self)

            def set_multiplier(grad: Tensor) -> None:
                call = ref()
                if call is not None:
                    call.multiplier = grad.detach()

            self.output.register_hook(set_multiplier)

    def ignored(self) -> int:
        """How many targets equal ``ignore_index`` (0 unless a mean CE/NLL loss)."""
        if self.target is None:
            return 0
        targets, index = self.target
        return int((targets == index).sum())


def last_loss_call(consume: bool = True) -> LossCall | None:
    """The most recent forward of an extended loss in this thread, or None."""
    call = getattr(_loss_calls, "last", None)
    if consume:
        _loss_calls.last = None
    return call


def _loss_forward_hook(module: nn.Module, inputs, output) -> None:
    if not torch.is_grad_enabled():
        return
    if not isinstance(output, Tensor) or output.dim() != 0:
        raise ValueError(
            f"{type(module).__name__} returned a tensor of shape {tuple(output.shape)}; gradlens "
            "needs a scalar loss: use reduction='mean' or 'sum'"
        )
    target = None
    if module.reduction == "mean" and isinstance(module, (nn.CrossEntropyLoss, nn.NLLLoss)):
        if getattr(module, "weight", None) is not None:
            raise ValueError(
                f"{type(module).__name__}(reduction='mean', weight=...) divides by the sum of "
                "class weights, not by the batch size, so per-sample gradients cannot be "
                "recovered; use reduction='sum' and divide the loss yourself"
            )
        if len(inputs) > 1 and isinstance(inputs[1], Tensor) and not inputs[1].is_floating_point():
            target = (inputs[1], module.ignore_index)  # checked by a tracked capture only
    call = LossCall(
        reduction=module.reduction,
        batch_size=int(inputs[0].shape[0]) if inputs[0].dim() > 0 else 1,
        output=output,
        target=target,
        module_name=type(module).__name__,
    )
    _loss_calls.last = call


def _is_loss(module: nn.Module) -> bool:
    return isinstance(module, nn.modules.loss._Loss)


def extend(module: nn.Module, exclude: Iterable[str] = ()) -> nn.Module:
    """Make ``module`` ready for gradlens and check it; returns the same module.

    For a loss module (``nn.CrossEntropyLoss``, ``nn.MSELoss``, ...): installs a light forward
    hook that tells :meth:`gradlens.Lens.capture` the reduction and batch size of the loss.

    For a model: checks every module that owns parameters. Unsupported modules (e.g. LayerNorm,
    GroupNorm, MultiheadAttention, GRU, a custom module with its own parameters) and Conv layers
    with ``padding_mode`` other than ``"zeros"`` raise ``TypeError``/``ValueError`` unless their
    parameters are excluded by qualified name or module-name prefix in ``exclude``; the exclusion
    is remembered and applied by every :class:`~gradlens.Lens` on this model. No hook is left on
    the model: the Lens installs its hooks for tracked windows only.

    Args:
        module: a model or a loss module.
        exclude: parameter names (``"fc.weight"``) or module names (``"fc"``, ``"encoder.norm"``)
            whose parameters gradlens must not track.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"extend() takes an nn.Module, got {type(module).__name__}")
    if _is_loss(module):
        if module.reduction not in ("mean", "sum"):
            raise ValueError(
                f"{type(module).__name__}(reduction={module.reduction!r}) is not supported: "
                "use reduction='mean' or 'sum' (per-sample losses for Alpha go to "
                "lens.capture(losses=...))"
            )
        if not hasattr(module, _LOSS_HOOK):
            setattr(module, _LOSS_HOOK, module.register_forward_hook(_loss_forward_hook))
        return module
    exclude = tuple(getattr(module, _EXCLUDE, ())) + tuple(exclude)
    watched_modules(module, exclude)  # raises on unsupported modules
    setattr(module, _EXCLUDE, exclude)
    setattr(module, _EXTENDED, True)
    return module


def is_extended(module: nn.Module) -> bool:
    return bool(getattr(module, _EXTENDED, False))


def model_exclusions(module: nn.Module) -> tuple[str, ...]:
    return tuple(getattr(module, _EXCLUDE, ()))


def _excluded(name: str, exclude: tuple[str, ...]) -> bool:
    return any(name == e or name.startswith(e + ".") for e in exclude if e)


@dataclass
class WatchedModule:
    """A module whose parameters are tracked: its name, kernel and tracked parameters."""

    name: str
    module: nn.Module
    kernel: Kernel
    params: dict[str, str]  # attribute ("weight") -> qualified name ("fc1.weight")

    @property
    def is_batchnorm(self) -> bool:
        return isinstance(self.module, nn.modules.batchnorm._BatchNorm)


def watched_modules(model: nn.Module, exclude: tuple[str, ...] = ()) -> list[WatchedModule]:
    """The modules of ``model`` whose parameters will be tracked, after exclusions.

    Raises:
        TypeError: a module with tracked parameters has no per-sample gradient kernel.
        ValueError: a Conv layer uses a ``padding_mode`` other than ``"zeros"``.
    """
    out: list[WatchedModule] = []
    for mname, mod in model.named_modules():
        own = {
            pn: (f"{mname}.{pn}" if mname else pn)
            for pn, p in mod.named_parameters(recurse=False)
            if p.requires_grad
        }
        own = {pn: q for pn, q in own.items() if not _excluded(q, exclude)}
        if not own:
            continue
        where = f"module {mname!r} ({type(mod).__name__})" if mname else type(mod).__name__
        try:
            kernel = kernel_for(mod)
        except TypeError:
            raise TypeError(
                f"{where} has parameters {sorted(own.values())} for which per-sample gradients "
                "are not available (BackPACK and gradlens support Linear, Conv, ConvTranspose, "
                "Embedding and eval-mode BatchNorm); exclude them: "
                f"gradlens.extend(model, exclude=[{mname!r}]) or Lens(..., exclude=[{mname!r}])"
            ) from None
        if getattr(mod, "padding_mode", "zeros") != "zeros":
            raise ValueError(
                f"{where} uses padding_mode={mod.padding_mode!r}; per-sample gradients need "
                f"padding_mode='zeros' (or exclude it: exclude=[{mname!r}])"
            )
        out.append(WatchedModule(mname, mod, kernel, own))
    return out


OnGrad = Callable[[WatchedModule, Tensor, Tensor, bool], None]
OnWeightGrad = Callable[[WatchedModule, Tensor], None]


def _weight_grad_node(output: Tensor, weight: Tensor):
    """The autograd node through which this call's dL/dW reaches ``weight`` (a leaf), for
    ``F.linear`` on a 2-D input (``addmm``/``mm`` of ``input`` and ``weight.t()``), else None.
    A hook on it sees exactly the weight gradient of this call, before other uses of the
    parameter (regularisers, reuse) are added to ``weight.grad``."""
    fn = output.grad_fn
    if fn is None or type(fn).__name__ not in ("AddmmBackward0", "MmBackward0"):
        return None
    for node, _ in fn.next_functions:
        if node is not None and type(node).__name__ == "TBackward0":
            leaf = node.next_functions[0][0] if node.next_functions else None
            if getattr(leaf, "variable", None) is weight:
                return node
    return None


class Tap:
    """Forward hooks on the watched modules that route output gradients to ``on_grad``.

    ``install()`` / ``remove()`` are idempotent. While installed, every forward pass with grad
    enabled attaches a hook to each watched module's output; ``on_grad(watched, input, grad)``
    runs when backward reaches that output.
    """

    def __init__(
        self,
        watched: list[WatchedModule],
        on_grad: OnGrad,
        sentinels: list[tuple[str, nn.Module]] = (),
        on_sentinel: Callable[[str, nn.Module], None] | None = None,
        on_weight_grad: OnWeightGrad | None = None,
    ):
        self.watched = watched
        self.on_grad = on_grad
        self.on_weight_grad = on_weight_grad
        self.sentinels = list(sentinels)
        self.on_sentinel = on_sentinel
        self._handles: list = []

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def install(self) -> None:
        if self._handles:
            return
        for w in self.watched:
            self._handles.append(w.module.register_forward_hook(self._make_hook(w)))
        for name, mod in self.sentinels:
            self._handles.append(mod.register_forward_hook(self._make_sentinel(name)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _make_hook(self, w: WatchedModule):
        on_grad, on_weight_grad = self.on_grad, self.on_weight_grad
        linear = on_weight_grad is not None and isinstance(w.module, nn.Linear) and "weight" in w.params

        def forward_hook(module, inputs, output):
            if not (torch.is_grad_enabled() and isinstance(output, Tensor) and output.requires_grad):
                return
            a = inputs[0]
            node = _weight_grad_node(output, module.weight) if linear else None
            if node is not None:  # sum_n g_n of the weight comes free with autograd's own dL/dW
                node.register_hook(lambda grad_in, grad_out: on_weight_grad(w, grad_in[0]))
            output.register_hook(lambda g: on_grad(w, a, g, node is not None))

        return forward_hook

    def _make_sentinel(self, name: str):
        on_sentinel = self.on_sentinel

        def forward_hook(module, inputs, output):
            if torch.is_grad_enabled() and isinstance(output, Tensor) and output.requires_grad:
                output.register_hook(lambda g: on_sentinel(name, module))

        return forward_hook
