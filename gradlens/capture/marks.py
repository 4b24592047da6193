"""What a tracked forward knows of tensors: the identity-keyed marks it reads and writes for
every torch call (:class:`_TensorMarks`: data tensors with their sample axis, tensors derived
from parameters only), and where the model's inputs and modules hold their samples (the
micro-batch of the first input, ``batch_first`` declarations, the ``[B, f, ...]`` view of a use
whose samples are the leading factor of an axis)."""

from __future__ import annotations

import weakref
from typing import Any, Iterable

from torch import Tensor, nn


def _tensors(args) -> Iterable[tuple[Any, Tensor]]:
    for i, x in enumerate(args):
        if isinstance(x, Tensor):
            yield i, x
        elif isinstance(x, (list, tuple)):
            for j, y in enumerate(x):
                if isinstance(y, Tensor):
                    yield (i, j), y


def _outputs(out) -> list[Tensor]:
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [o for o in out if isinstance(o, Tensor)]
    return []


def _input_batch(inputs: tuple, hint: int) -> tuple[int, int] | None:
    """(sample axis, micro-batch size) read from the model's first input tensor that has a
    dimension: axis ``hint`` (1 under a ``batch_first=False`` model) where it has one, else 0."""
    first = next((x for _, x in _tensors(inputs) if x.dim() > 0), None)
    if first is None:
        return None
    ax = hint if first.dim() > hint else 0
    return ax, int(first.shape[ax])


def _batch_first(t: Tensor, ax: int, factor: int, batch: int, rows_last: bool = False) -> Tensor:
    """``t`` with its sample axis ``ax`` moved to dim 0; ``[B * f, ...] -> [B, f, ...]`` where
    the samples are the leading factor of that axis (``[B, ..., f]`` with ``rows_last``: a
    kernel's :attr:`~gradlens.kernels.Kernel.rows_last`)."""
    t = t.movedim(ax, 0) if ax else t
    if factor == 1:
        return t
    t = t.reshape(batch, factor, *t.shape[1:])
    return t.movedim(1, -1) if rows_last else t


def _declared(model: nn.Module) -> dict[int, tuple[str, int]]:
    """id(module) -> (what it declares, the sample axis of its 3-D input) for modules that say
    ``batch_first`` themselves (RNNs, MultiheadAttention, transformer layers)."""
    out = {}
    for m in model.modules():
        for obj in (m, getattr(m, "self_attn", None)):
            bf = getattr(obj, "batch_first", None)
            if isinstance(bf, bool):
                out[id(m)] = (f"batch_first={bf}", 0 if bf else 1)
                break
    return out


def _hints(model: nn.Module) -> dict[int, int]:
    """id(module) -> the sample axis its 3-D activations use: 1 under a ``batch_first=False``
    attention/RNN/transformer layer, else 0 (inherited from the nearest module that says)."""
    def own(m):
        for obj in (m, getattr(m, "self_attn", None)):
            bf = getattr(obj, "batch_first", None)
            if isinstance(bf, bool):
                return 0 if bf else 1
        layers = getattr(m, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers):
            return own(layers[0])
        return None

    out: dict[int, int] = {}

    def visit(m, inherited):
        h = own(m)
        h = inherited if h is None else h
        out[id(m)] = h
        for c in m.children():
            visit(c, h)

    visit(model, 0)
    return out


class _TensorMarks:
    """Tensor -> value for live tensors, keyed by identity. What
    ``torch.utils.weak.WeakIdKeyDictionary`` does, at a fraction of its per-lookup Python cost
    (the forward's mode looks up every tensor argument of every torch call).

    ``_d`` maps ``id(x)`` to ``(weakref.ref(x), value)``; an entry counts only while its
    reference still gives ``x`` (a freed tensor's id may be reused by a new tensor: its entry
    then no longer matches). The references carry no callback (CPython shares one such
    reference per tensor, and a freed tensor runs no Python): entries of freed tensors are
    dropped by :meth:`sweep` (at the end of each tracked forward, and whenever the dict has
    doubled since the last sweep). The mode reads and writes ``_d`` directly, the same way."""

    __slots__ = ("_d", "_limit")

    def __init__(self):
        self._d: dict[int, tuple[weakref.ref, Any]] = {}
        self._limit = 1024

    def get(self, x: Tensor, default: Any = None) -> Any:
        e = self._d.get(id(x))
        return e[1] if e is not None and e[0]() is x else default

    def __contains__(self, x: Tensor) -> bool:
        e = self._d.get(id(x))
        return e is not None and e[0]() is x

    def __getitem__(self, x: Tensor) -> Any:
        e = self._d.get(id(x))
        if e is None or e[0]() is not x:
            raise KeyError(id(x))
        return e[1]

    def __setitem__(self, x: Tensor, value: Any) -> None:
        d = self._d
        d[id(x)] = (_ref(x), value)
        if len(d) > self._limit:
            self.sweep()

    def sweep(self) -> None:
        """Drop the entries of freed tensors."""
        d = self._d
        dead = [k for k, e in d.items() if e[0]() is None]
        for k in dead:
            del d[k]
        self._limit = max(1024, 2 * len(d))

    def __len__(self) -> int:
        return sum(1 for e in self._d.values() if e[0]() is not None)


_ref = weakref.ref
