"""Losses the model composes inside its forward (``(CE_a + CE_b) / 2``, ``CE / c``): which
factor belongs to the objective and which is divided out (docs/design.md, "Units").

g_n is the gradient of sample n's own loss *as the model returns it*: a factor the model applies
inside its forward is part of the objective; only what multiplies the returned loss afterwards
(the loop's 1/K, a GradScaler's scale) is divided out. A hook on a loss function's output
measures the product of both, so the two are told apart by where the forward ends:

* while a tracked forward runs, :class:`LossChain` follows every loss computed in it (a loss
  function, an extended loss module) through the operations applied to it (the capture's
  ``TorchFunctionMode`` hands it each call that takes one of them), noting whether the result is
  still linear in the losses (sums, differences, products with and quotients by values that
  need no gradient: :func:`gradlens.capture.samples.linear_in_pooled`);
* when the forward returns, each returned tensor computed from losses becomes a :class:`Root`
  of those losses; the capture hooks it, so its gradient is exactly what multiplied the model's
  returned loss afterwards;
* :meth:`gradlens.capture.units.MicroStep.resolve` divides out the gradient at the roots that
  backward reached (not the one at the losses), and refuses a loss that reached backward
  through a root that is not linear in the losses, or through operations inside the forward
  that lead to no returned value (the two factors cannot be told apart there).

A loss computed outside the model's forward (an extended loss module on the logits) is its own
returned loss: everything between it and ``backward`` is divided out, as before.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from gradlens.capture import samples
from gradlens.capture.losses import _Multiplier, follow_losses
from gradlens.capture.marks import _tensors

__all__ = ["Root", "LossChain"]


class Root:
    """A tensor the model's forward returned that is computed from losses of that forward (the
    loss itself, or ``(ce_a + ce_b) / 2``): ``seen`` receives d(backpropagated)/d(root), the
    factor applied after the model (1/K, a GradScaler scale); ``value`` is the root detached;
    ``linear``: whether it is a linear combination of the losses (else ``what`` names the first
    operation that is not)."""

    __slots__ = ("tensor", "seen", "value", "linear", "what")

    def __init__(self, tensor: Tensor, linear: bool, what: str | None):
        self.tensor: Tensor | None = tensor
        self.seen = _Multiplier()
        self.value = tensor.detach()
        self.linear = linear
        self.what = what

    @property
    def multiplier(self) -> Tensor | None:
        """d(backpropagated objective)/d(root) once backward passed it; None if it did not."""
        return self.seen.value

    def watch(self) -> None:
        """Hook the root (once, a tracked capture only), then forget it."""
        t, self.tensor = self.tensor, None
        if t is not None and t.requires_grad:
            t.register_hook(self.seen)


def _returned(output: Any, depth: int = 0) -> list[Tensor]:
    """The tensors of a forward's output: a tensor, or one inside (nested) tuples, lists and
    dicts (a Hugging Face ``ModelOutput`` is a dict), down to a few levels."""
    if isinstance(output, Tensor):
        return [output]
    if depth > 2:
        return []
    if isinstance(output, dict):
        items = output.values()
    elif isinstance(output, (list, tuple)):
        items = output
    else:
        return []
    return [t for o in items for t in _returned(o, depth + 1)]


class LossChain:
    """The losses computed during one tracked forward, followed to what the forward returns.

    ``marks``: id -> (tensor, ids of the losses it is computed from, linear, what) for every
    tensor computed from a loss of this forward (strong references until the forward ends);
    ``calls``: the loss calls noted during the forward."""

    def __init__(self) -> None:
        self.marks: dict[int, tuple] = {}
        self.calls: list = []
        self.consumed: set[int] = set()

    def begin(self) -> None:
        """A tracked forward starts (in this thread): losses noted until :meth:`end` are
        followed."""
        self.marks, self.calls, self.consumed = {}, [], set()
        follow_losses(self)

    def note(self, call: Any) -> None:
        """A loss noted during this forward (:func:`gradlens.capture.losses._note_loss`); an
        extended loss module around a loss function seen inside it is one loss."""
        out = call.output
        if out is None:
            return
        self.calls = [c for c in self.calls if c.output is not out] + [call]
        self.marks[id(out)] = (out, frozenset((id(out),)), True, None)

    def follow(self, func, args, kwargs, out) -> None:
        """A torch call of the forward: if it takes a tensor computed from losses, its outputs
        are too (linear in them when ``func`` is, with at most one argument that needs a
        gradient in a product, none in a divisor)."""
        marks = self.marks
        found = []
        grads = []
        items = list(_tensors(args))
        if kwargs:
            items.extend((k, v) for k, v in kwargs.items() if isinstance(v, Tensor))
        for pos, x in items:
            m = marks.get(id(x))
            if m is not None and m[0] is x:
                found.append(m)
            if x.requires_grad:
                grads.append((pos, x))
        if not found:
            return
        outs = [out] if isinstance(out, Tensor) else [o for o in out if isinstance(o, Tensor)] \
            if isinstance(out, (list, tuple)) else []
        outs = [o for o in outs if o.requires_grad]
        if not outs:  # (``loss.detach()`` for a log: no gradient goes that way)
            return
        ids = frozenset().union(*(m[1] for m in found))
        self.consumed.update(ids)
        linear = all(m[2] for m in found) and samples.linear_in_pooled(func, grads)
        what = next((m[3] for m in found if m[3] is not None), None)
        if not linear and what is None:
            what = getattr(func, "__name__", str(func))
        for o in outs:
            marks[id(o)] = (o, ids, linear, what)

    def end(self, output: Any) -> None:
        """The forward returned ``output``: each returned tensor computed from losses becomes a
        :class:`Root` of them (``call.roots``); ``call.consumed`` says whether an operation of
        the forward took the loss. Then the chain is emptied for the next forward."""
        marks = self.marks
        roots: dict[int, list[Root]] = {}
        seen: set[int] = set()
        for o in _returned(output) if self.calls else ():
            m = marks.get(id(o))
            if m is None or m[0] is not o or id(o) in seen:
                continue
            seen.add(id(o))
            root = Root(o, m[2], m[3])
            for i in m[1]:
                roots.setdefault(i, []).append(root)
        for call in self.calls:
            i = id(call.output)
            call.roots = roots.get(i, [])
            call.consumed = i in self.consumed
        self.marks, self.calls, self.consumed = {}, [], set()
        follow_losses(None, ending=self)
