"""The losses a forward computes, and what a capture needs to know of them.

A loss is reported as a :class:`LossCall` (its reduction, batch size, and later the multiplier
that backward applied to it) by an extended loss module's forward hook
(:func:`_loss_forward_hook`, installed by :func:`gradlens.capture.tracked.extend`), by a loss
function called inside a tracked forward (:func:`_note_functional_loss`, from the capture's
``TorchFunctionMode``), or by the ``loss=`` of ``lens.capture``. They queue per thread until a
capture takes them (:func:`take_loss_calls`). A loss on flattened rows (``logits.view(-1, V)``)
has its samples settled against the model's input (:func:`settle_rows`).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradlens import compat

__all__ = ["LossCall", "pending_loss_calls", "take_loss_calls", "put_back_loss_calls", "settle_rows", "settle_samples", "follow_losses"]

_loss_calls = threading.local()


class _Multiplier:
    """Receives d(backpropagated objective)/d(loss) from a hook on the loss output. It holds no
    reference to the loss tensor, so the hook makes no reference cycle through the graph."""

    __slots__ = ("value",)

    def __init__(self):
        self.value: Tensor | None = None

    def __call__(self, grad: Tensor) -> None:
        self.value = grad.detach()


@dataclass(eq=False)
class LossCall:
    """A loss computed with grad enabled: an extended loss module's forward, a loss function
    inside the model's forward, or the ``loss=`` of ``lens.capture``."""

    reduction: str
    batch_size: int | None
    output: Tensor | None  # the loss (0-d) until a capture hooks it, then dropped
    target: tuple[Tensor, int] | None = None  # (class targets, ignore_index) of a mean CE/NLL
    #: the targets' count that a mean CE/NLL divided by (those not ``ignore_index``), a 0-d
    #: tensor, taken by :meth:`watch_multiplier` when there are more targets than samples (a
    #: token-mean loss); None otherwise
    counted: Tensor | None = None
    module_name: str = ""
    #: the loss input's dim 0 is a row-major flattening of these leading dims (``[B, T]`` of
    #: ``logits.view(-1, V)``); ``batch_size`` is then their product until the Meter settles it
    rows: tuple[int, ...] | None = None
    #: the autograd node of the tensor that was flattened (walked up through copies and slices
    #: of other dims); compared with the model's outputs, then dropped
    rows_node: Any = None
    #: the autograd node of the loss input (walked up through copies) and its shape: where the
    #: input is an output of the model whose samples are not on dim 0 (``extend(model,
    #: batch_dim=1)``, packed sequences), its batch is the model's; compared, then dropped
    input_node: Any = None
    input_shape: tuple = ()
    value: Tensor | None = None
    seen: _Multiplier = field(default_factory=_Multiplier)
    #: computed inside a tracked forward: the returned tensors computed from this loss
    #: (:class:`gradlens.capture.composed.Root`; the loss itself where the model returns it)
    roots: list = field(default_factory=list)
    #: computed inside a tracked forward, an operation of that forward took it (``loss / 2``)
    consumed: bool = False

    def __post_init__(self):
        if self.value is None and self.output is not None:
            self.value = self.output.detach()

    @property
    def multiplier(self) -> Tensor | None:
        """d(backpropagated objective)/d(loss), known once backward passed the loss: 1 for
        loss.backward(), S under GradScaler, 1/K for "divide the loss by K" recipes; None if this
        loss was not backpropagated."""
        return self.seen.value

    def watch_multiplier(self) -> None:
        """Hook the loss output (a tracked capture only: untracked steps pay nothing), then
        forget it."""
        if self.output is not None and self.output.requires_grad:
            self.output.register_hook(self.seen)
        for root in self.roots:  # (shared by the losses it is computed from: hooked once)
            root.watch()
        samples = self.rows[0] if self.rows else self.batch_size
        if self.counted is None and self.target is not None and samples and self.target[0].numel() > samples:
            y, ignore = self.target
            self.counted = (y != ignore).sum()  # on y's device: no host read
        self.output = None
        self.target = None
        self.rows_node = None
        self.input_node = None


#: losses computed since the last capture, in this thread (a validation forward's too: only
#: those that backward reaches count)
_PENDING = 16


def _pending() -> deque:
    q = getattr(_loss_calls, "pending", None)
    if q is None:
        q = _loss_calls.pending = deque(maxlen=_PENDING)
    return q


def pending_loss_calls() -> int:
    """How many losses were computed since the last capture (in this thread)."""
    return len(_pending())


def take_loss_calls() -> list[LossCall]:
    """The losses computed since the last call (in this thread), oldest first."""
    q = _pending()
    out = list(q)
    q.clear()
    return out


def put_back_loss_calls(calls: list[LossCall]) -> None:
    """Make ``calls`` (oldest first) pending again, before those computed since (a pipeline
    stage hands each micro-batch's backward only its own loss, :mod:`gradlens.lens.pipeline`)."""
    q = _pending()
    for call in reversed(calls):
        q.appendleft(call)


def follow_losses(chain: Any, ending: Any = None) -> None:
    """While a tracked forward runs in this thread, the losses noted are also handed to
    ``chain`` (a :class:`gradlens.capture.composed.LossChain`); ``follow_losses(None,
    ending=chain)``: that forward ended (nothing changes if another chain follows by now)."""
    if ending is not None and getattr(_loss_calls, "chain", None) is not ending:
        return
    _loss_calls.chain = chain


def _note_loss(call: LossCall) -> None:
    chain = getattr(_loss_calls, "chain", None)
    if chain is not None:
        chain.note(call)
    q = _pending()
    if q and q[-1].output is not None and q[-1].output is call.output:
        q[-1] = call  # an extended loss module around a loss function seen inside: one loss
    else:
        q.append(call)


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
    flat = _flattened_rows(inputs[0]) if isinstance(inputs[0], Tensor) else None
    call = LossCall(
        reduction=module.reduction,
        batch_size=int(inputs[0].shape[0]) if inputs[0].dim() > 0 else 1,
        output=output,
        target=target,
        module_name=type(module).__name__,
        rows=flat[0] if flat else None,
        rows_node=flat[1] if flat else None,
        input_node=_copied_from(inputs[0]) if isinstance(inputs[0], Tensor) and not flat else None,
        input_shape=tuple(inputs[0].shape) if isinstance(inputs[0], Tensor) else (),
    )
    _note_loss(call)


_KEEP_LEADING = ("CloneBackward0", "ToCopyBackward0", "AliasBackward0")


def _flattened_rows(x: Tensor) -> tuple[tuple[int, ...], Any] | None:
    """``(lead, node)`` if ``x`` (a loss input ``[R, *rest]``) is a view/reshape that flattened
    the leading dims ``lead`` (``prod(lead) == R``) of a tensor ``[*lead, *rest]``, e.g.
    ``logits.view(-1, V)`` of ``[B, T, V]`` logits; ``node`` is that tensor's autograd node,
    walked up through copies (``.float()``, ``.contiguous()``) and slices of other dims (the
    shift ``logits[:, :-1]``), all of which keep dim 0. Else None."""
    if x.dim() < 1 or x.grad_fn is None:
        return None
    sizes = compat.view_input_sizes(x.grad_fn)
    if sizes is None:
        return None
    k = len(sizes) - (x.dim() - 1)
    if k < 2 or tuple(sizes[k:]) != tuple(x.shape[1:]) or math.prod(sizes[:k]) != x.shape[0]:
        return None
    node = x.grad_fn.next_functions[0][0] if x.grad_fn.next_functions else None
    while node is not None and (compat.node_name(node) in _KEEP_LEADING or compat.slice_dim(node) not in (None, 0)):
        node = node.next_functions[0][0] if node.next_functions else None
    return tuple(sizes[:k]), node


def _copied_from(x: Tensor) -> Any:
    """The autograd node of ``x``, walked up through copies (``.float()``, ``.contiguous()``)."""
    node = x.grad_fn
    while node is not None and compat.node_name(node) in _KEEP_LEADING:
        node = node.next_functions[0][0] if node.next_functions else None
    return node


def settle_samples(call: LossCall, batch: int | None, output_nodes: dict) -> None:
    """A loss whose input is an output of the model holding its samples elsewhere than on dim 0
    (``[T, B, ...]`` under ``extend(model, batch_dim=1)``; the packed data of sequences): its
    batch is the model's micro-batch. Sets ``call.batch_size``."""
    if batch is None or call.batch_size == batch or call.input_node is None:
        return
    ax = output_nodes.get(call.input_node)
    if ax is None:
        return
    if type(ax) is not tuple or (ax[1] == 1 and ax[0] < len(call.input_shape) and call.input_shape[ax[0]] == batch):
        call.batch_size = batch  # (a tuple subclass: rows of samples, e.g. packed sequences)


def settle_rows(call: LossCall, batch: int | None, output_nodes: dict) -> None:
    """A loss on flattened rows (``call.rows``, e.g. ``[B, T]`` of ``logits.view(-1, V)``): its
    samples are the micro-batch ``batch`` of the model's input where the rows' leading dim is
    that micro-batch, and that dim is known to hold the samples: no other of the leading dims
    has that size, or the flattened tensor is an output of the model whose samples are on dim 0.
    Sets ``call.batch_size``; otherwise leaves it (the Meter's batch check then refuses it)."""
    rows = call.rows
    if rows is None or batch is None or call.batch_size == batch:
        return
    ax = output_nodes.get(call.rows_node, None)
    if type(ax) is tuple and ax[1] == 1 and 0 < ax[0] < len(rows) and rows[ax[0]] == batch:
        call.batch_size = batch  # a sequence-first output ([T, B, V] logits of batch_dim=1) flattened
        return
    if rows[0] != batch:
        return
    if batch in rows[1:] and ax != (0, 1):
        return  # dim 0 has the micro-batch size, but so has another: which holds the samples?
    call.batch_size = batch


_LOSS_FUNCTIONS = frozenset(
    {
        F.cross_entropy,
        F.nll_loss,
        F.mse_loss,
        F.l1_loss,
        F.smooth_l1_loss,
        F.huber_loss,
        F.binary_cross_entropy,
        F.binary_cross_entropy_with_logits,
        F.soft_margin_loss,
    }
)


def _note_functional_loss(func, kwargs, out, batch, args=()) -> None:
    """A loss function called inside the model's forward (e.g. ``model(x, labels=y).loss`` of
    transformers): reported like an extended loss module, so ``lens.capture()`` knows its
    reduction and divides out what multiplied it in backward (1/K, a GradScaler scale). A mean
    ``F.cross_entropy`` / ``F.nll_loss`` on class targets keeps them (its counted targets)."""
    reduction = kwargs.get("reduction", "mean")
    if reduction not in ("mean", "sum") or not isinstance(out, Tensor) or out.dim() != 0:
        return
    if reduction == "mean" and kwargs.get("weight") is not None:
        return  # divides by the sum of class weights: no per-sample split
    target = None
    if reduction == "mean" and func in (F.cross_entropy, F.nll_loss):
        y = args[1] if len(args) > 1 else kwargs.get("target")
        if isinstance(y, Tensor) and not y.is_floating_point():
            target = (y, int(kwargs.get("ignore_index", -100)))
    _note_loss(LossCall(reduction=reduction, batch_size=batch, output=out, target=target,
                        module_name=f"F.{func.__name__}"))
