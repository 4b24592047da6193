"""Capture: which parameters are tracked, and how one micro-step's backward reaches the
instruments.

``extend(model)`` marks a model (and remembers exclusions); ``extend(loss_fn)`` makes a loss
module report its reduction and batch size. A :class:`Tap` is installed *only while a tracked
window is open* (untracked steps cost what a plain step costs). During a tracked forward it
follows every use of a tracked parameter:

- a module with a closed-form kernel in :mod:`gradlens.capture.registry` (Linear, Conv, Embedding, the
  norms, ...) is one *site*: its input is kept and its output hooked;
- modules with a registered tracked-window forward (``nn.MultiheadAttention``, RNNs) run it, so
  that their parameters are used through batch-first ``F.linear`` calls;
- every other operation is seen by a ``TorchFunctionMode``: tensors computed from the batch
  ("data") and from parameters only ("derived") are told apart, and the operation where a
  parameter (or a derived tensor) meets the batch is hooked; ``F.linear`` there is a site, the
  rest follows the exact per-operation rules of :mod:`gradlens.capture.ops`.

In backward each hooked output hands its gradient down to the Meter (:mod:`gradlens.measure.meter`),
which rescales it to per-sample units and measures it. Where the Meter materialises a sequence ``nn.Linear``'s per-sample weight
gradients anyway (sum of squares, exact histograms, BatchDot), that call runs as a
``_FusedLinear`` whose backward takes dL/dW from their sum instead of a second matmul. The sample axis of a use is followed from the model's input (dim 0, the
``batch_dim`` given to :func:`extend`, or dim 1 where the model says ``batch_first=False``)
through every data operation (:mod:`gradlens.capture.axes`), never guessed from sizes where they are
ambiguous. A tracked window runs a compiled model eagerly (compiler stance ``force_eager``).

What the mode costs is Python per torch call (its dispatch, then the lookups and marks here), so
it sees only the calls whose capture needs it: a site's own inner calls, and the calls inside a
parameter-free elementwise module (dropout, activations: :func:`gradlens.capture.registry.elementwise`),
run with the mode off the torch-function stack (when it is the innermost mode; a user's own mode
inside the forward keeps it on, the site's calls then passed through); their outputs get the
marks that following those calls gives. The marks are tensor -> value maps read and written in
place by the mode (:class:`_TensorMarks`), and the common operation (one output of its data
argument's shape, no axis rule) is marked without the rules of :mod:`gradlens.capture.axes`.

Why not BackPACK's own module hooks: ``backpack.extend`` installs full backward hooks that stay
on the model and cost ~1.6x a plain step on a 784-512-512-10 MLP even outside a ``backpack``
context. gradlens uses BackPACK's derivatives (see :mod:`gradlens.kernels`) but attaches its own
light hooks for tracked windows only.
"""

from __future__ import annotations

import functools
import math
import threading
import weakref
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torch.overrides import TorchFunctionMode

from gradlens import compat

from gradlens.capture import axes, ops
from gradlens.kernels import EmbeddingKernel, Kernel, LayerNormKernel, LinearKernel, OpLinear
from gradlens.capture.registry import elementwise, forward_for, kernel_for, qualname

__all__ = ["extend", "LossCall", "take_loss_calls", "Tap", "ParamTap", "Site", "tracked_parameters", "trainable_split"]

_EXTENDED = "_gradlens_extended"
_EXCLUDE = "_gradlens_exclude"
_LOSS_HOOK = "_gradlens_loss_hook"
_BATCH_DIM = "_gradlens_batch_dim"

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
    module_name: str = ""
    #: the loss input's dim 0 is a row-major flattening of these leading dims (``[B, T]`` of
    #: ``logits.view(-1, V)``); ``batch_size`` is then their product until the Meter settles it
    rows: tuple[int, ...] | None = None
    #: the autograd node of the tensor that was flattened (walked up through copies and slices
    #: of other dims); compared with the model's outputs, then dropped
    rows_node: Any = None
    value: Tensor | None = None
    seen: _Multiplier = field(default_factory=_Multiplier)

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
        self.output = None
        self.target = None
        self.rows_node = None


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


def _note_loss(call: LossCall) -> None:
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


def settle_rows(call: LossCall, batch: int | None, output_nodes: dict) -> None:
    """A loss on flattened rows (``call.rows``, e.g. ``[B, T]`` of ``logits.view(-1, V)``): its
    samples are the micro-batch ``batch`` of the model's input where the rows' leading dim is
    that micro-batch, and that dim is known to hold the samples: no other of the leading dims
    has that size, or the flattened tensor is an output of the model whose samples are on dim 0.
    Sets ``call.batch_size``; otherwise leaves it (the Meter's batch check then refuses it)."""
    rows = call.rows
    if rows is None or batch is None or call.batch_size == batch or rows[0] != batch:
        return
    if batch in rows[1:] and output_nodes.get(call.rows_node, None) != (0, 1):
        return  # dim 0 has the micro-batch size, but so has another: which holds the samples?
    call.batch_size = batch


def _is_loss(module: nn.Module) -> bool:
    return isinstance(module, nn.modules.loss._Loss)


def extend(module: nn.Module, exclude: Iterable[str] = (), batch_dim: int | None = None) -> nn.Module:
    """Make ``module`` ready for gradlens and check it; returns the same module.

    For a loss module (``nn.CrossEntropyLoss``, ``nn.MSELoss``, ...): installs a light forward
    hook that tells :meth:`gradlens.Lens.capture` the reduction and batch size of the loss.

    For a model: marks it and remembers ``exclude``; every trainable parameter not excluded is
    tracked by each :class:`~gradlens.Lens` on it (see :mod:`gradlens.capture.registry` for how each
    layer is handled). No hook is left on the model: the Lens installs its hooks for tracked
    windows only.

    Args:
        module: a model or a loss module.
        exclude: parameter names (``"fc.weight"``, ``"cls_token"``) or module names (``"fc"``,
            ``"encoder.norm"``) whose parameters gradlens must not track.
        batch_dim: the sample axis of the model's inputs (``1`` for sequence-first ``[T, B]``
            inputs); default: 0, or 1 where the model itself says ``batch_first=False``. From
            there the axis is followed through the forward, never guessed from sizes.
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
    if isinstance(exclude, str):
        raise TypeError(f"exclude must be a list of names, got the string {exclude!r}; use exclude=[{exclude!r}]")
    if batch_dim is not None:
        if isinstance(batch_dim, bool) or not isinstance(batch_dim, int) or batch_dim < 0:
            raise ValueError(
                f"batch_dim must be a non-negative int (the inputs' sample axis), got {batch_dim!r}; "
                "e.g. gradlens.extend(model, batch_dim=1) for [T, B] inputs"
            )
        setattr(module, _BATCH_DIM, batch_dim)
    exclude = tuple(getattr(module, _EXCLUDE, ())) + tuple(exclude)
    tracked_parameters(module, exclude)  # checks the names
    setattr(module, _EXCLUDE, exclude)
    setattr(module, _EXTENDED, True)
    return module


def declared_batch_dim(module: nn.Module) -> int | None:
    """The inputs' sample axis given to :func:`extend` (``batch_dim=``), else None."""
    return getattr(module, _BATCH_DIM, None)


def is_extended(module: nn.Module) -> bool:
    return bool(getattr(module, _EXTENDED, False))


def model_exclusions(module: nn.Module) -> tuple[str, ...]:
    return tuple(getattr(module, _EXCLUDE, ()))


def _excluded(name: str, exclude: tuple[str, ...]) -> bool:
    return any(name == e or name.startswith(e + ".") for e in exclude if e)




def tracked_parameters(model: nn.Module, exclude: tuple[str, ...] = ()) -> dict[str, nn.Parameter]:
    """Qualified name -> parameter for every trainable parameter of ``model`` not excluded (a
    shared parameter once, under its first name in ``named_parameters()``).

    Raises:
        ValueError: a name in ``exclude`` matches no parameter or module of ``model``.
    """
    if any(exclude):
        names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        names |= {n for n, _ in model.named_modules(remove_duplicate=False) if n}
        for e in exclude:
            if e and not any(n == e or n.startswith(e + ".") for n in names):
                raise ValueError(
                    f"exclude names {e!r}, which is neither a parameter nor a module of "
                    f"{type(model).__name__}; names are as in model.named_parameters() "
                    "(e.g. 'encoder.norm.weight') or model.named_modules() (e.g. 'encoder.norm')"
                )
    return trainable_split(model, exclude)[0]


def trainable_split(model: nn.Module, exclude: tuple[str, ...] = ()) -> tuple[dict[str, nn.Parameter], int]:
    """(the parameters :func:`tracked_parameters` returns, without checking ``exclude``; the
    number of trainable elements of ``model``, excluded ones included), in one walk."""
    params, total = {}, 0
    for n, p in compat.named_parameters(model):
        if p.requires_grad:
            total += p.numel()
            if not exclude or not _excluded(n, exclude):
                params[n] = p
    return params, total


@dataclass(eq=False)
class Site:
    """One use of tracked parameters with a closed-form kernel: a module call, an ``F.linear``
    call, or (built by the Lens) a parameter whose per-sample gradients were materialised.

    Attributes:
        name: unique within a micro-step, stable across micro-steps (module name, or
            ``"op<k>:<param>"`` for the k-th operation of a forward).
        module: what the kernel reads (the module, or a stand-in with the same attributes).
        kernel: the :class:`~gradlens.kernels.Kernel`.
        params: attribute (``"weight"``) -> qualified name of the tracked parameter.
    """

    name: str
    module: Any
    kernel: Kernel
    params: dict[str, str]

    def only(self, attrs) -> "Site":
        """The same use restricted to the parameters ``attrs``."""
        return Site(self.name, self.module, self.kernel, {a: q for a, q in self.params.items() if a in attrs})


#: Called in backward (:meth:`gradlens.measure.meter.Meter.on_use`): (site, input a [B, ...], output
#: gradient [B, ...], the attributes whose dL/dp comes via the call's autograd node (a frozenset;
#: see _hook_param_grads), micro-batch size seen in forward, id
#: of that forward pass; keyword ``fused=True`` for a fused Linear call), returning that call's
#: dL/dW when the measurement formed it (else None)
OnUse = Callable[..., "Tensor | None"]


@dataclass(eq=False)
class OpUse:
    """An operation where tracked parameters (or tensors derived from parameters only) meet the
    batch; per-sample gradients follow :func:`gradlens.capture.ops.per_sample_wrt`."""

    name: str
    func: Callable
    args: tuple
    kwargs: dict
    inputs: list  # (position, tensor, frozenset of qualified names)
    axis: int
    batch: int
    forward: int = 0  # id of the forward pass
    #: rows per sample on ``axis`` (its size is ``batch * factor``, samples the leading factor)
    factor: int = 1


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


def _only_axis(shape, batch: int) -> int | None:
    """The one axis of ``shape`` whose size is the micro-batch size, or None (none, or several:
    then the size says nothing)."""
    cands = [i for i, s in enumerate(shape) if s == batch]
    return cands[0] if len(cands) == 1 else None


#: kernels whose input may hold several rows per sample: rows of one sample are positions
_FACTOR_KERNELS: tuple = (LinearKernel, LayerNormKernel, EmbeddingKernel)


def _batch_first(t: Tensor, ax: int, factor: int, batch: int) -> Tensor:
    """``t`` with its sample axis ``ax`` moved to dim 0; ``[B * f, ...] -> [B, f, ...]`` where
    the samples are the leading factor of that axis."""
    t = t.movedim(ax, 0) if ax else t
    return t.reshape(batch, factor, *t.shape[1:]) if factor != 1 else t


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


#: torch calls that only read a tensor's metadata (they return no tensor): the mode passes
#: them through before any lookup (about a third of the calls in a transformer's forward)
_METADATA = frozenset(
    [getattr(torch.Tensor, n).__get__ for n in (
        "shape", "dtype", "device", "requires_grad", "ndim", "is_cuda", "layout", "is_sparse",
        "is_leaf", "grad_fn", "is_meta", "is_quantized")]
    + [getattr(torch.Tensor, n) for n in (
        "dim", "size", "numel", "nelement", "ndimension", "stride", "is_floating_point", "is_complex",
        "is_contiguous", "element_size", "get_device", "data_ptr", "__len__")]
)


_RULED = axes.RULED
_NOTHING: frozenset = frozenset()

#: argument types that are no tensor and hold none (as the mode's scan reads arguments: a
#: list or tuple is looked into, nothing else): the scan passes them at once
_PLAIN = frozenset({int, float, bool, complex, str, type(None), type(Ellipsis), slice, torch.dtype,
                    torch.device, torch.Size, torch.layout, torch.memory_format})


class _UseMode(TorchFunctionMode):
    """Sees every torch call of a tracked forward (outside closed-form sites)."""

    def __init__(self, tap: "Tap"):
        super().__init__()
        self.tap = tap

    def __torch_function__(self, func, types, args=(), kwargs=None):
        tap = self.tap
        if tap._skip or func in _METADATA:
            return func(*args, **kwargs) if kwargs else func(*args)
        kind = _KINDS.get(func)
        if kind is None:
            kind = _kind(func)
        if kwargs and kind & _IS_LINEAR:
            full = list(args) + [None] * (3 - len(args))
            for i, k in enumerate(("input", "weight", "bias")):
                if k in kwargs:
                    full[i] = kwargs[k]
            args, kwargs = tuple(full), None
        # one pass over the tensor arguments (a list argument's too, in order): data (its mark),
        # a tracked parameter, a tensor derived from parameters only, or a tensor the mode did
        # not see being made. The marks are read straight from their dict (see _TensorMarks).
        data = tap._data._d
        is_data = False
        first = None  # the first data argument
        fax = None  # its sample axis
        tracked = None
        lead = True  # the first data argument is args[0], the others are plain (ints, shapes, ...)
        i = -1
        for x in args:
            i += 1
            if type(x) in _PLAIN:
                continue
            if isinstance(x, Tensor):
                e = data.get(id(x))
                if e is not None and e[0]() is x:
                    if first is None:
                        first, fax, is_data = x, e[1], True
                        lead = lead and i == 0
                    else:
                        lead = False
                    continue
                lead = False
                items = ((i, x),)
            elif isinstance(x, (list, tuple)) and x:
                items = []
                for j, y in enumerate(x):
                    if isinstance(y, Tensor):
                        lead = False
                        e = data.get(id(y))
                        if e is not None and e[0]() is y:
                            if first is None:
                                first, fax, is_data = y, e[1], True
                        else:
                            items.append(((i, j), y))
                    elif type(y) not in _PLAIN:
                        lead = False
            else:
                lead = False  # an argument of another kind: not kept in the axes' memo
                continue
            for pos, y in items:
                got = tap._not_data(pos, y)
                if got is True:
                    is_data = True
                elif got is not None:
                    if tracked is None:
                        tracked = [got]
                    else:
                        tracked.append(got)
        if kwargs:
            lead = False
            for k, x in kwargs.items():
                if isinstance(x, Tensor):
                    e = data.get(id(x))
                    if e is not None and e[0]() is x:
                        if first is None:
                            first, fax, is_data = x, e[1], True
                        continue
                    got = tap._not_data(k, x)
                    if got is True:
                        is_data = True
                    elif got is not None:
                        if tracked is None:
                            tracked = [got]
                        else:
                            tracked.append(got)
        else:
            kwargs = _NO_KWARGS
        grad = torch.is_grad_enabled()  # off: e.g. inside a custom autograd.Function (follow the batch)
        if grad and is_data and kind & _IS_BATCH_NORM:
            training = args[5] if len(args) > 5 else kwargs.get("training", False)
            if training or args[1] is None:
                tap._taint_before(args[0], "F.batch_norm (batch statistics)")
        if tracked is None or not grad:
            out = func(*args, **kwargs) if kwargs else func(*args)
            if is_data:
                if isinstance(out, Tensor):  # one output: its mark set here
                    batch = tap._batch
                    if fax is None or batch is None:
                        ax = None
                    elif not kind & _IS_RULED and fax[0] < out.dim() and out.shape == first.shape:
                        ax = fax  # the common case: what axes.carry gives without its rules
                    elif lead:  # the rule's answer depends on the shapes and the other arguments only
                        ax = _carried(func, args, first, fax, out, batch)
                    else:
                        ax = axes.carry(func, args, kwargs, first, fax, [out], batch)[0]
                    data[id(out)] = (_ref(out), ax)
                    if len(data) > tap._data._limit:
                        tap._data.sweep()
                else:
                    tap._carry(func, args, kwargs, first, fax, out)
                if grad and kind & _IS_LOSS:
                    _note_functional_loss(func, kwargs, out, tap._batch)
            return out
        if not is_data:
            out = func(*args, **kwargs)
            names = frozenset().union(*(t[2] for t in tracked))
            for o in _outputs(out):
                if o.requires_grad:
                    tap._derived[o] = names
            return out
        if ops.is_inplace(func):  # keep the inputs as they were for the per-sample rule
            saved = tuple(a.clone() if isinstance(a, Tensor) and a in tap._data else a for a in args)
        else:
            saved = args
        out = func(*args, **kwargs)
        tap._carry(func, args, kwargs, first, fax, out)
        tap._meet(func, saved, kwargs, tracked, out)
        return out


#: what the mode needs to know of a torch function besides its arguments, as bit flags (one
#: dict read per call): its sample-axis rule is not the default one, it is a loss, F.batch_norm,
#: F.linear
_IS_RULED, _IS_LOSS, _IS_BATCH_NORM, _IS_LINEAR = 1, 2, 4, 8
_KINDS: dict = {}
_NO_KWARGS: dict = {}  # (never written)


def _kind(func) -> int:
    """:data:`_KINDS` of ``func``, computed on its first call."""
    kind = ((_IS_RULED if getattr(func, "__name__", "") in _RULED else 0)
            | (_IS_LOSS if func in _LOSS_FUNCTIONS else 0)
            | (_IS_BATCH_NORM if func is F.batch_norm else 0) | (_IS_LINEAR if func is F.linear else 0))
    if len(_KINDS) > 4096:
        _KINDS.clear()
    _KINDS[func] = kind
    return kind


#: (func, axis, batch, input shape, output shape, other arguments) -> the output's axis, for the
#: calls whose only tensor is their first argument and whose other arguments are plain values
#: (a view, transpose, slice of the data): the memo holds no tensor and no object of the model
_AXES: dict = {}


def _carried(func, args: tuple, x: Tensor, ax, out: Tensor, batch: int):
    """``axes.carry`` of a call whose only tensor argument is ``x = args[0]``: its rule reads the
    shapes, the axis, the batch size and the other (plain) arguments alone, so the answer is
    kept per such key (a forward repeats the same calls layer after layer and step after step)."""
    try:
        key = (func, ax, batch, x.shape, out.shape, args[1:])
        got = _AXES.get(key, _AXES)
    except TypeError:  # an unhashable argument (a slice, before Python 3.12)
        key, got = None, _AXES
    if got is _AXES:
        got = axes.carry(func, args, _NO_KWARGS, x, ax, [out], batch)[0]
        if key is not None:
            if len(_AXES) > 4096:
                _AXES.clear()
            _AXES[key] = got
    return got


class Tap:
    """The hooks of a tracked window (see the module docstring). ``install()`` / ``remove()``
    are idempotent; per micro-step state (use counts, parameters that received a gradient,
    parameters whose per-sample gradient is undefined) is read and reset by the Meter.

    The callbacks are the :class:`gradlens.measure.meter.Meter`'s event methods: capture calls down
    into the measurement, never up into the Lens.

    Args:
        model: the extended model.
        params: qualified name -> tracked parameter.
        on_use: receives each closed-form site use in backward (see :data:`OnUse`).
        on_op_use: receives ``(OpUse, output gradient)`` in backward.
        on_weight_grad: optional; receives autograd's own dL/dW of a 2-D ``nn.Linear`` call.
    """

    def __init__(
        self,
        model: nn.Module,
        params: dict[str, nn.Parameter],
        on_use: OnUse,
        on_op_use: Callable[[OpUse, Tensor], None],
        on_weight_grad: Callable[[Site, Tensor], None] | None = None,
    ):
        self.model = model
        self.on_use, self.on_op_use, self.on_weight_grad = on_use, on_op_use, on_weight_grad
        self._handles: list = []
        self._replaced: list[nn.Module] = []
        self._hint = _hints(model)
        self._mode = _UseMode(self)
        self._mode_depth = 0
        #: how deep the forward is inside closed-form sites: their inner calls are theirs
        self._skip = 0
        #: the outermost site being run took the mode off the torch-function stack (it was the
        #: innermost mode): its inner calls and the site hooks' own bookkeeping then pay no
        #: dispatch; its post-hook puts the mode back
        self._mode_out = False
        self._hooks_gen = 0  # bumped by remove(): hooks made before it do nothing (see _module_hooks)
        self._batch: int | None = None
        self._batch_dim = declared_batch_dim(model)
        #: the model runs under torch.compile (set by the Lens): while installed, the compiler's
        #: stance is "force_eager" (back to "default" on remove, or if the Tap is collected)
        self.run_eager = False
        self._eager = None
        self._declared = _declared(model)
        #: what the sample axis of a use could not be found for, this forward (one error lists all)
        self.axis_errors: list[str] = []
        #: autograd node -> sample axis ((dim, factor) or None) of the data tensors the model's
        #: last forward returned (until the capture ends)
        self.output_nodes: dict = {}
        #: data tensor -> its sample axis (see :mod:`gradlens.capture.axes`)
        self._data = _TensorMarks()
        self._derived = _TensorMarks()
        self._visited: set = set()
        self._ops = 0
        self.forward_id = 0
        #: the layer classes (:data:`LINEAR`, :data:`CONV1D`) whose sequence calls take dL/dW
        #: from the Meter (set by the Meter from its plan, before install)
        self.fuse_weight_grad: frozenset = frozenset()
        #: ``(site, input, output) -> bool``: a routed use whose dL/dp the Meter forms itself
        #: (small stacked uses, :func:`gradlens.measure.deferred.sums_here`) gets no autograd-node
        #: hook; None: every routed use is hooked (set by the Meter)
        self.sums_here = None
        #: ``(elements, batch, materialised) -> bool``: whether a use of that size may be
        #: stacked (:func:`gradlens.measure.deferred.fits`; a fused Linear call is never stacked, so a
        #: small one runs unfused); None: nothing is stacked (set by the Meter)
        self.stacks_if = None
        self.set_params(params)
        self.reset_micro()

    def set_params(self, params: dict[str, nn.Parameter]) -> None:
        """The tracked parameters (their sites are rebuilt; hooks reinstalled if installed)."""
        was = self.installed
        self.remove()
        self.params = dict(params)
        self._pid = {id(p): q for q, p in self.params.items()}
        self._single = {q: frozenset((q,)) for q in self.params}
        self.sites: dict[int, tuple[nn.Module, Site | None]] = {}
        self._names = {id(m): n for n, m in self.model.named_modules()}
        for name, mod in self.model.named_modules():
            kernel = kernel_for(mod)
            if kernel is None:
                continue
            own = {
                attr: self._pid[id(p)]
                for attr, p in mod.named_parameters(recurse=False)
                if id(p) in self._pid and p is self.params[self._pid[id(p)]]
            }
            site = Site(name or type(mod).__name__, mod, kernel, own) if own else None
            self.sites[id(mod)] = (mod, site)
        if was:
            self.install()

    def reset_micro(self) -> None:
        self.uses: Counter = Counter()
        self.received: set[str] = set()
        self.tainted: dict[str, str] = {}  # qualified name -> the mixing layer it reaches
        self.axis_errors = []
        self.output_nodes = {}
        self._visited = set()
        self._ops = 0

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    # ------------------------------------------------------------------ install / remove
    def install(self) -> None:
        if self._handles:
            return
        # hooks are closures, not bound methods: copy.deepcopy(model) during a tracked window
        # must not copy the Tap (and the Lens, its sinks, ...)
        root, tap = self.model, self
        self._handles.append(
            # k=None: this hook was removed by an earlier pre-hook of the same forward (the Lens
            # refreshing its parameters, which then opens the forward itself); torch still calls
            # it, without kwargs: nothing to do
            root.register_forward_pre_hook(lambda m, a, k=None: None if k is None else tap._root_pre(m, a, k),
                                           with_kwargs=True)
        )
        for mod in root.modules():
            entry = self.sites.get(id(mod))
            site_mod = entry is not None
            if (mod is not root and not site_mod and elementwise(mod) and "forward" not in mod.__dict__
                    and id(mod) not in self._declared):
                # its forward does what its hooks would (opens the forward when called on its own)
                mod.forward = _TrackedForward(_elementwise_forward, mod, self)
                self._replaced.append(mod)
                continue
            pre, post = self._module_hooks(mod, entry[1] if site_mod else None, site_mod, mod is root)
            self._handles.append(mod.register_forward_pre_hook(pre, with_kwargs=mod is not root))
            self._handles.append(mod.register_forward_hook(post, always_call=True))
            fwd = forward_for(mod)
            if fwd is not None and any(id(p) in self._pid for p in mod.parameters()):
                mod.forward = _TrackedForward(fwd, mod, self)
                self._replaced.append(mod)
            elif site_mod and qualname(type(mod)) in self.fuse_weight_grad and entry[1] is not None \
                    and "weight" in entry[1].params and "forward" not in mod.__dict__:
                mod.forward = _TrackedForward(_FUSED[qualname(type(mod))], mod, self)
                self._replaced.append(mod)
        # last, so that the module hooks of the root (a model that is one layer) run before it
        self._handles.append(root.register_forward_hook(lambda m, a, o: tap._root_post(m, a, o), always_call=True))
        for q, p in self.params.items():
            self._handles.append(p.register_post_accumulate_grad_hook(self._received(q)))
        self._apply_stance()

    def _apply_stance(self) -> None:
        """A tracked forward follows every operation in Python: under torch.compile it runs
        eagerly while the Tap is installed (no graph break, no recompile; the compiled graphs
        serve the untracked windows)."""
        if self.run_eager and self._handles and self._eager is None and compat.compile_stance() == "default":
            compat.set_compile_stance("force_eager")
            self._eager = weakref.finalize(self, compat.set_compile_stance, "default")

    def eager_from_now(self) -> None:
        """The model turned out to run compiled (a Lens given the plain module): the next
        tracked forwards run eagerly, also while the Tap stays installed across windows."""
        self.run_eager = True
        self._apply_stance()

    def remove(self) -> None:
        if self._eager is not None:
            self._eager()  # the stance back to "default" (once; the finalizer is then dead)
            self._eager = None
        for h in self._handles:
            h.remove()
        self._handles = []
        for mod in self._replaced:
            mod.__dict__.pop("forward", None)
        self._replaced = []
        if self._mode_depth:  # removed inside a tracked forward: the mode is on the stack once
            self._mode_depth = 0
            if not self._mode_out:
                self._mode.__exit__(None, None, None)
        self._mode_out = False
        self._skip = 0
        self._hooks_gen += 1  # hooks made before this removal do nothing if torch still runs them

    def _received(self, q: str):
        def hook(p):
            self.received.add(q)

        return hook

    # ------------------------------------------------------------------ forward hooks
    def _root_pre(self, module, args, kwargs):
        if not torch.is_grad_enabled() or _in_functorch():
            return None  # no gradients here, or a torch.func transform of the model (an oracle)
        if self._mode_depth == 0:
            inputs = tuple(args) + tuple(kwargs.values())
            hint = self._batch_dim if self._batch_dim is not None else self._hint.get(id(module), 0)
            found = _input_batch(inputs, hint)
            if found is not None:
                ax, self._batch = found
                for _, x in _tensors(inputs):
                    if x.dim() > ax and x.shape[ax] == self._batch:
                        self._data[x] = (ax, 1)
            self.forward_id += 1
            self._mode.__enter__()
        self._mode_depth += 1
        return None

    def _root_post(self, module, args, output):
        if self._mode_depth:
            self._mode_depth -= 1
            if self._mode_depth == 0:
                if self._mode_out:  # (not reached: a site's post-hook always puts it back)
                    self._mode_out = False
                else:
                    self._mode.__exit__(None, None, None)
                outs = list(output.values()) if isinstance(output, dict) else _outputs(output)
                data = self._data
                self.output_nodes = {
                    o.grad_fn: data[o] for o in outs if isinstance(o, Tensor) and o in data and o.grad_fn is not None
                }
        return None

    def _module_hooks(self, mod: nn.Module, site: Site | None, is_site: bool, is_root: bool):
        """The forward pre-hook and (always called) forward hook of ``mod``:

        * a submodule called on its own (``model.encoder(x)``, not inside the model's own
          forward) opens and closes the tracked forward (a root);
        * a module that says where its samples are (``batch_first``) checks its input's axis;
        * a closed-form site (a module with a kernel in the registry): its inner calls are its
          own (the mode steps off the torch-function stack for them, or passes them through),
          and its use is noted in the post-hook (:meth:`_site_use`).
        """
        declared = self._declared.get(id(mod))
        gen = self._hooks_gen
        use = self._site_use(mod, site) if is_site else None
        entered: list[bool] = []  # per call of a submodule: whether it opened the forward

        def pre(module, args, kwargs=None):  # kwargs too: hf_model(input_ids=..., labels=...)
            if not is_root:
                first = self._mode_depth == 0 and torch.is_grad_enabled() and not _in_functorch()
                entered.append(first)
                if first:
                    self._root_pre(module, args, kwargs)
            if gen != self._hooks_gen or not self._mode_depth:  # (stale: removed earlier in this forward)
                return None
            if declared is not None and args and isinstance(args[0], Tensor):
                self._check_declared(module, declared, args[0])
            if is_site:
                if not self._skip and compat.top_function_mode() is self._mode:
                    self._mode.__exit__(None, None, None)  # back in the site's post-hook
                    self._mode_out = True
                self._skip += 1
            return None

        def site_post(module, args, output):
            if not self._mode_depth:
                return None
            self._skip -= 1
            try:
                return use(module, args, output)
            finally:
                if self._mode_out and not self._skip:  # the outermost site: the mode back on
                    self._mode_out = False
                    self._mode.__enter__()

        if is_root:
            return pre, (site_post if is_site else _no_post)

        def post(module, args, output):
            try:
                return site_post(module, args, output) if is_site else None
            finally:
                if entered and entered.pop():
                    self._root_post(module, args, output)

        return pre, post

    def _site_use(self, mod: nn.Module, site: Site | None):
        """The post-hook work of a closed-form site: its output takes the sample axis of its
        input (or its derived names), and its output gradient is hooked for the Meter."""
        routed = site is not None and _routes_param_grads(mod, site.kernel)
        stacks = routed and site.kernel.stack_key(mod, tuple(site.params)) is not None
        stateful = isinstance(mod, compat.BatchNormBase)  # kernel follows train/eval
        is_embedding = isinstance(mod, nn.Embedding)
        may_fuse = qualname(type(mod)) in _FUSED  # (only these run a fused forward)
        data = self._data

        def use(module, args, output):
            nonlocal site
            if not (isinstance(output, Tensor) and args and isinstance(args[0], Tensor) and torch.is_grad_enabled()):
                return None
            kernel = kernel_for(module) if stateful else None
            if site is not None and kernel is not None and type(kernel) is not type(site.kernel):
                site = Site(site.name, module, kernel, site.params)
            a = args[0]
            e = data._d.get(id(a))
            if e is not None and e[0]() is a and e[1] is not None:
                ax = e[1]  # data, with the axis carried to it
            elif self._is_data(a):
                ax = self.axis_of(a)  # the axis unknown, or made where the mode did not see it
            else:
                if site is not None and output.requires_grad:
                    names = frozenset(site.params.values()) | self._derived.get(a, frozenset())
                    self._derived[output] = names
                elif a in self._derived and output.requires_grad:
                    self._derived[output] = self._derived[a]
                return None
            if is_embedding and ax is None and a.dim() <= 1:
                ax = (0, 1)  # ids [B]: one id per sample
            data[output] = ax if output.dim() >= a.dim() else None  # a layer keeps the axis
            if getattr(kernel, "mixes_samples", False):
                self._taint_before(a, f"{site.name if site else type(module).__name__!r} ({type(module).__name__} with batch statistics)")
            if site is None or not output.requires_grad:
                return None
            batch = self._batch
            if ax is None or (ax[1] != 1 and not isinstance(site.kernel, _FACTOR_KERNELS)):
                self._refuse_axis(
                    output,
                    f"the input of {site.name!r} ({type(module).__name__}, shape {tuple(a.shape)})"
                    + ("" if ax is None else f" holds the samples as the leading factor of dim {ax[0]}"),
                )
                return None
            ax, factor = ax
            uses = self.uses
            for q in site.params.values():
                uses[q] = uses.get(q, 0) + 1
            a_b = _batch_first(a, ax, factor, batch) if ax or factor != 1 else a
            via: frozenset = _NOTHING  # attributes whose dL/dp of this call autograd reports
            if routed and self.on_weight_grad is not None and not (
                    stacks and self.sums_here is not None and self.sums_here(site, a, output)):
                with compat.no_torch_function():
                    via = _hook_param_grads(output, module, site, self.on_weight_grad)
            on_use, fid = self.on_use, self.forward_id
            wg = getattr(output, "_gradlens_weight_grad", None) if may_fuse else None
            if wg is not None:  # a fused call: the meter returns its dL/dW if it formed it

                def hook(g):
                    wg.value = on_use(site, a_b, _batch_first(g, ax, factor, batch), via, batch, fid, fused=True)

            else:

                def hook(g):
                    return on_use(site, a_b, _batch_first(g, ax, factor, batch), via, batch, fid)

            with compat.no_torch_function():  # bookkeeping, not a call of the forward
                compat.add_tensor_hook(output, hook)
            return None

        return use

    # ------------------------------------------------------------------ the sample axis
    def _check_declared(self, module: nn.Module, declared: tuple[str, int], x: Tensor) -> None:
        """A module that says where its samples are (``batch_first``): an input whose carried
        axis is unknown takes it; one that disagrees is an error (listed with the others)."""
        what, want = declared
        if x.dim() != 3 or x not in self._data:
            return
        ax = self._data[x]
        if ax is None:
            self._data[x] = (want, 1)
        elif ax[0] != want:
            self._refuse_axis(
                x, f"{self.name_of(module)!r} ({type(module).__name__}, {what}) takes its samples on dim "
                f"{want} of its input {tuple(x.shape)}, but the model's input put them on dim {ax[0]}"
            )

    def _unary(self, x: Tensor, out: Any) -> None:
        """The marks the mode gives ``out``, computed from ``x`` alone by elementwise operations
        (an output of ``x``'s shape; see :func:`_elementwise_forward`): ``x``'s sample axis if
        ``x`` is data (None for data the mode did not see made), its names if ``x`` is a
        tracked parameter or derived from parameters only (with grad enabled), else nothing."""
        if not isinstance(out, Tensor):
            return
        e = self._data._d.get(id(x))
        if e is not None and e[0]() is x:
            self._data[out] = e[1] if out.shape == x.shape else None
            return
        got = self._not_data(0, x)
        if got is True:
            self._data[out] = None
        elif got is not None and torch.is_grad_enabled() and out.requires_grad:
            self._derived[out] = got[2]

    def _not_data(self, pos, x: Tensor):
        """A tensor argument without a data mark, at ``pos``: ``(pos, x, names)`` for a tracked
        parameter or a tensor derived from parameters only, True for a tensor that requires
        grad without either (computed by something the mode did not see, e.g. a custom kernel:
        data), else None (a constant)."""
        q = self._pid.get(id(x))
        if q is not None and x is self.params[q]:
            return (pos, x, self._single[q])
        e = self._derived._d.get(id(x))
        if e is not None and e[0]() is x and e[1]:
            return (pos, x, e[1])
        if x.requires_grad and not isinstance(x, nn.Parameter):
            return True
        return None

    def _carry(self, func, args, kwargs, first: Tensor | None, ax: Any, out) -> None:
        """Every output of a data operation is data, with the sample axis its rule gives
        (``first`` the operation's first data argument, ``ax`` its axis)."""
        outs = [out] if isinstance(out, Tensor) else _outputs(out)
        if first is None:
            axs = [None] * len(outs)
        else:
            axs = axes.carry(func, args, kwargs, first, ax, outs, self._batch)
        data = self._data
        for o, ax in zip(outs, axs):
            data[o] = ax

    def axis_of(self, x: Tensor) -> tuple[int, int] | None:
        """The sample axis ``(dim, factor)`` of data tensor ``x``: the carried one, else the one
        axis whose size is the micro-batch size (only if exactly one has it), else None."""
        ax = self._data[x] if x in self._data else None
        if ax is not None:
            return ax
        only = _only_axis(x.shape, self._batch)
        return None if only is None else (only, 1)

    def _refuse_axis(self, t: Tensor, what: str) -> None:
        """A use whose sample axis is unknown: the micro-step's first use in backward raises
        ONE error naming every such use (:meth:`axis_error`)."""
        if what not in self.axis_errors:
            self.axis_errors.append(what)

    def axis_error(self) -> RuntimeError | None:
        """The error for the uses of this micro-step's forwards whose sample axis is unknown."""
        errors = self.axis_errors
        if not errors:
            return None
        return RuntimeError(
            f"gradlens cannot tell the sample axis at {len(errors)} place(s) of the forward "
            f"(micro-batch of {self._batch}): " + "; ".join(errors) + ". Declare the sample axis "
            "of the model's input once (gradlens.extend(model, batch_dim=1) for [T, B, ...] "
            "inputs), keep the samples on one axis (or as the leading factor of one axis) through "
            "views, reshapes and permutes, or leave these modules out with Lens(..., exclude=[...])"
        )

    def _is_data(self, x: Tensor) -> bool:
        """``x`` carries samples: computed from the model's inputs, or (made by an operation the
        mode cannot see, e.g. a custom kernel) requiring grad without being derived from
        parameters only."""
        if x in self._data:
            return True
        return x.requires_grad and x not in self._derived and id(x) not in self._pid

    # ------------------------------------------------------------------ operations
    def _meet(self, func, args, kwargs, tracked, out) -> None:
        """An operation combining tracked parameters (or derived tensors) with the batch."""
        outs = _outputs(out)
        if not outs or not outs[0].requires_grad:
            return
        fname = getattr(func, "__name__", str(func))
        if len(outs) != 1:
            raise NotImplementedError(
                f"gradlens: {fname} combines the parameters {sorted(set().union(*(t[2] for t in tracked)))} "
                "with the batch and returns several tensors; per-sample gradients of such "
                "operations are not supported: exclude these parameters (Lens(..., exclude=[...]))"
            )
        out = outs[0]
        batch = self._batch
        ax = self.axis_of(out)
        if ax is None:
            self._refuse_axis(
                out,
                f"the output of {fname} (shape {tuple(out.shape)}), which uses the parameters "
                f"{sorted(set().union(*(t[2] for t in tracked)))}",
            )
            return
        ax, factor = ax
        k = self._ops
        self._ops += 1
        positions = {t[0] for t in tracked}
        if func is F.linear and positions <= {1, 2} and 1 in positions and isinstance(args[0], Tensor):
            w = args[1]
            bias = args[2] if len(args) > 2 else None
            direct = all(t[1] is self.params.get(next(iter(t[2]))) for t in tracked)
            if direct and (bias is None or 2 in positions or not bias.requires_grad):
                names = {"weight": next(iter(tracked[[t[0] for t in tracked].index(1)][2]))}
                if 2 in positions:
                    names["bias"] = next(iter(tracked[[t[0] for t in tracked].index(2)][2]))
                site = Site(f"op{k}:{names['weight']}", OpLinear(w, bias, tuple(names)), LinearKernel(), names)
                for q in names.values():
                    self.uses[q] += 1
                a_b = _batch_first(args[0], ax, factor, batch)
                on_use, fid = self.on_use, self.forward_id
                compat.add_tensor_hook(out, lambda g: on_use(site, a_b, _batch_first(g, ax, factor, batch), False, batch, fid))
                return
        detached = tuple(
            a.detach() if isinstance(a, Tensor) else
            (type(a)(x.detach() if isinstance(x, Tensor) else x for x in a) if isinstance(a, (list, tuple)) else a)
            for a in args
        )
        kw = {n: (v.detach() if isinstance(v, Tensor) else v) for n, v in kwargs.items()}
        use = OpUse(f"op{k}:{fname}", func, detached, kw, list(tracked), ax, batch, self.forward_id, factor)
        for _, _, names in tracked:
            for q in names:
                self.uses[q] += 1
        on_op_use = self.on_op_use
        compat.add_tensor_hook(out, lambda g: on_op_use(use, g))

    def _taint_before(self, x: Tensor, layer: str) -> None:
        """Every tracked parameter whose output reaches ``x`` (the input of a layer that mixes
        samples) has an undefined per-sample gradient."""
        stack = [x.grad_fn]
        visited = self._visited
        while stack:
            node = stack.pop()
            if node is None or node in visited:
                continue
            visited.add(node)
            var = getattr(node, "variable", None)
            if var is not None:
                q = self._pid.get(id(var))
                if q is not None:
                    self.tainted.setdefault(q, layer)
                continue
            stack.extend(n for n, _ in node.next_functions)

    def name_of(self, module: nn.Module) -> str:
        """The qualified name of a module of the model (``""`` for the root)."""
        return self._names.get(id(module), type(module).__name__)

    def mark_data(self, x: Tensor, axis: int | None = None) -> None:
        """Declare ``x`` (made inside a tracked forward, e.g. an RNN's zero initial state) part
        of the batch, its samples on dim ``axis`` (None: the one dim of the micro-batch size,
        if only one has it)."""
        if axis is None:
            axis = _only_axis(x.shape, self._batch)
        self._data[x] = None if axis is None else (axis, 1)

    @property
    def batch(self) -> int | None:
        return self._batch


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


def _note_functional_loss(func, kwargs, out, batch) -> None:
    """A loss function called inside the model's forward (e.g. ``model(x, labels=y).loss`` of
    transformers): reported like an extended loss module, so ``lens.capture()`` knows its
    reduction and divides out what multiplied it in backward (1/K, a GradScaler scale)."""
    reduction = kwargs.get("reduction", "mean")
    if reduction not in ("mean", "sum") or not isinstance(out, Tensor) or out.dim() != 0:
        return
    if reduction == "mean" and kwargs.get("weight") is not None:
        return  # divides by the sum of class weights: no per-sample split
    _note_loss(LossCall(reduction=reduction, batch_size=batch, output=out, module_name=f"F.{func.__name__}"))



class _LossMode(TorchFunctionMode):
    """The only thing a :class:`ParamTap` watches inside a forward: loss functions called there
    (``model(x, labels=y).loss``), reported like an extended loss module."""

    def __init__(self, tap: "ParamTap"):
        super().__init__()
        self.tap = tap

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _LOSS_FUNCTIONS and args and isinstance(args[0], Tensor) and args[0].requires_grad:
            _note_functional_loss(func, kwargs, out, self.tap.batch)
        return out


class ParamTap:
    """The hooks of a tracked window whose instruments need no per-sample gradient, only the
    window's gradient sum and each micro-step's gradient norm (``GradNorm``,
    ``NoiseScaleTwoBatch``): no layer is looked at, so every model works as it is, layers
    without a kernel and train-mode BatchNorm included.

    * a forward pre-hook on the model: the micro-batch size (the model's first input, as the
      :class:`Tap` reads it) and a small ``TorchFunctionMode`` that notes loss functions called
      inside the forward;
    * one tensor hook per tracked parameter: ``on_grad(name, grad)`` with the ``dL/dp`` of each
      backward, before it is added to ``p.grad`` (and before DDP all-reduces it).

    Same surface as :class:`Tap` where the Lens reads it (``params``, ``uses``, ``received``,
    ``tainted``, ``forward_id``, ``batch``, ``install``/``remove``/``set_params``/``reset_micro``).
    """

    def __init__(self, model: nn.Module, params: dict[str, nn.Parameter], on_grad: Callable[[str, Tensor], None]):
        self.model = model
        self.on_grad = on_grad
        self._handles: list = []
        self._hint = _hints(model)
        self._mode = _LossMode(self)
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
        self._handles.append(root.register_forward_hook(lambda m, a, o: tap._post(), always_call=True))
        for q, p in self.params.items():
            if p.requires_grad:
                self._handles.append(p.register_hook(self._grad_hook(q)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        while self._depth:
            self._depth -= 1
            self._mode.__exit__(None, None, None)

    def _grad_hook(self, q: str):
        on_grad = self.on_grad

        def hook(grad: Tensor) -> None:
            on_grad(q, grad)

        return hook

    def _pre(self, module, args, kwargs):
        if not torch.is_grad_enabled() or _in_functorch():
            return None
        if self._depth == 0:
            dim = declared_batch_dim(module)
            found = _input_batch(tuple(args) + tuple(kwargs.values()), self._hint.get(id(module), 0) if dim is None else dim)
            if found is not None:
                self.batch = found[1]
            self.forward_id += 1
            self._mode.__enter__()
        self._depth += 1
        return None

    def _post(self) -> None:
        if self._depth:
            self._depth -= 1
            if self._depth == 0:
                self._mode.__exit__(None, None, None)


def _in_functorch() -> bool:
    return compat.in_functorch_transform()


def _no_post(module, args, output) -> None:
    return None


class _TrackedForward:
    """``module.forward`` during tracked windows (a registered tracked-window forward). A deep
    copy of the module taken meanwhile gets the module's own forward back."""

    def __init__(self, fwd: Callable, module: nn.Module, tap: Tap):
        self.fwd, self.module, self.tap = fwd, module, tap

    def __call__(self, *args, **kwargs):
        return self.fwd(self.module, self.tap, *args, **kwargs)

    def __deepcopy__(self, memo):
        copied = memo.get(id(self.module))
        return type(copied).forward.__get__(copied) if copied is not None else None


class WeightGrad:
    """One call of a fused ``nn.Linear`` (:func:`_fused_forward`): its dL/dW when the
    Meter formed it while measuring the call (the sum of the per-sample gradients it
    materialised anyway, divided by the per-sample scale), else None and the call's backward
    computes it. Written only by the output hook of :meth:`Tap._site_use` (from the value
    :meth:`gradlens.measure.meter.Meter.on_use` returns), read by :class:`_FusedLinear`."""

    __slots__ = ("value",)

    def __init__(self):
        self.value: Tensor | None = None


class _FusedLinear(torch.autograd.Function):
    """``F.linear`` whose backward takes dL/dW from its :class:`WeightGrad` when the Meter formed
    it (the output's hook, which measures the call, runs before this backward), so that the
    weight-gradient matmul is not computed twice. Input and bias gradients as ``F.linear``.
    ``transposed``: the weight is ``[d_in, d_out]`` (transformers' ``Conv1D``, ``y = x W + b``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, holder, transposed=False):
        ctx.save_for_backward(x, weight)
        ctx.holder, ctx.has_bias, ctx.transposed = holder, bias is not None, transposed
        if transposed:  # as Conv1D computes it: addmm of the rows with W
            out = x.reshape(-1, x.shape[-1])
            out = torch.mm(out, weight) if bias is None else torch.addmm(bias, out, weight)
            return out.view(*x.shape[:-1], weight.shape[1])
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = g.matmul(weight.t() if ctx.transposed else weight)
        if ctx.needs_input_grad[1]:
            gw, ctx.holder.value = ctx.holder.value, None
            if gw is None or torch.is_grad_enabled():
                # not measured (a shared weight, an empty batch), or a differentiable backward
                # (create_graph=True): what the layer's own backward does, so double backward works
                gw = x.reshape(-1, x.shape[-1]).t().mm(g2)
                gw = gw if ctx.transposed else gw.t()
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0)
        return gx, gw, gb, None, None


def _autocast(x: Tensor) -> bool:
    """Whether autocast is on for ``x``'s device (the fused call then steps aside: its backward
    would not see the dtypes autocast chose in forward)."""
    try:
        return torch.is_autocast_enabled(x.device.type)
    except TypeError:  # older torch: no device argument
        return torch.is_autocast_enabled()


#: fewest multiply-adds of a call's weight gradient for it to run fused: below, the Python
#: autograd Function's own cost (forward and backward) exceeds the product it saves
FUSE_MIN = 1 << 20


def _fuses(module: nn.Module, tap: "Tap", x: Tensor, d_out: int) -> bool:
    """Whether a call of a Linear-like layer on ``x`` runs fused: a sequence input in a tracked
    forward, gradients on, no autocast, no torch.func transform, a weight gradient of at least
    :data:`FUSE_MIN` multiply-adds, and not small enough to be stacked (``tap.stacks_if``:
    measured with others like it at the window's end, which beats fusing; ``d_out`` the output
    width)."""
    return (tap._mode_depth and x.dim() > 2 and x.numel() * d_out >= FUSE_MIN and module.weight.requires_grad
            and x.dtype == module.weight.dtype and torch.is_grad_enabled() and not _in_functorch()
            and not _autocast(x) and not (tap.stacks_if is not None and _stacks(module, tap, x, d_out)))


def _fused_forward(module: nn.Module, tap: "Tap", x: Tensor, transposed: bool = False) -> Tensor:
    """``nn.Linear.forward`` (``transposed``: transformers' ``Conv1D.forward``, ``x W + b`` with
    ``W [d_in, d_out]``) during tracked windows of a Lens that materialises the per-sample weight
    gradients of sequence inputs ``[B, T, d]`` anyway (sum of squares): where :func:`_fuses`
    says so, the call is a :class:`_FusedLinear` whose :class:`WeightGrad` rides on the output
    for the site hook; elsewhere the layer's own forward."""
    if _fuses(module, tap, x, module.weight.shape[1 if transposed else 0]):
        holder = WeightGrad()
        out = _FusedLinear.apply(x, module.weight, module.bias, holder, transposed)
        out._gradlens_weight_grad = holder
        return out
    return type(module).forward(module, x)


#: qualified names of the layer classes whose calls may run fused (exactly these classes, whose
#: forward is known: a subclass may compute something else)
LINEAR, CONV1D = "torch.nn.modules.linear.Linear", "transformers.pytorch_utils.Conv1D"
#: class name -> its tracked-window forward
_FUSED = {LINEAR: _fused_forward, CONV1D: functools.partial(_fused_forward, transposed=True)}


def _stacks(module: nn.Module, tap: "Tap", x: Tensor, d_out: int) -> bool:
    """Whether the Meter may stack this Linear-like call by its size (``tap.stacks_if``): it is
    small enough to be measured with others like it at the window's end, which beats fusing."""
    rows = x.numel() // max(x.shape[-1], 1)
    numel = module.weight.numel() + (module.bias.numel() if module.bias is not None else 0)
    return tap.stacks_if(x.numel() + rows * d_out, tap._batch or x.shape[0], numel)


def _elementwise_forward(module: nn.Module, tap: "Tap", *args, **kwargs):
    """The forward of a parameter-free elementwise module (:func:`gradlens.capture.registry.elementwise`:
    dropout, activations) during tracked windows, instead of the Tap's module hooks: its own
    forward, run with the mode off the torch-function stack when the mode is the innermost one
    (back on after it, also on an exception); its output then takes the marks that following
    its operations one by one gives (:meth:`Tap._unary`). Called on its own (not inside the
    model's forward), it opens and closes the tracked forward, as the hooks of any other
    submodule do. The module's own hooks run as usual, with the mode on."""
    if not tap._mode_depth and torch.is_grad_enabled() and not _in_functorch():
        tap._root_pre(module, args, kwargs)  # called on its own: a root
        out = None
        try:
            out = _elementwise_forward(module, tap, *args, **kwargs)
            return out
        finally:
            tap._root_post(module, args, out)
    fwd = type(module).forward
    if (kwargs or len(args) != 1 or not isinstance(args[0], Tensor) or not tap._mode_depth or tap._skip
            or tap._mode_out or compat.top_function_mode() is not tap._mode):
        return fwd(module, *args, **kwargs)
    x = args[0]
    tap._mode.__exit__(None, None, None)
    tap._mode_out = True
    try:
        out = fwd(module, x)
        tap._unary(x, out)  # (with the mode off: its metadata reads are not calls of the forward)
    finally:
        if tap._mode_out:  # (unless the Tap was removed meanwhile)
            tap._mode_out = False
            tap._mode.__enter__()
    return out


#: autograd nodes of one-call layer forwards whose inputs include the layer's parameters
#: directly (``F.linear``/``Conv1D``'s addmm or mm, ``F.layer_norm``, ``F.embedding``)
_ROUTED_NODES = ("AddmmBackward0", "MmBackward0", "NativeLayerNormBackward0", "EmbeddingBackward0")


def _routes_param_grads(module: nn.Module, kernel: Kernel) -> bool:
    """Whether the autograd node of ``module``'s call sees exactly that call's dL/dp of its
    parameters: torch's own Linear, LayerNorm and (dense, without ``max_norm`` or
    ``scale_grad_by_freq``) Embedding, and
    transformers' ``Conv1D``: each forward is one torch call of its input and parameters."""
    from gradlens.kernels import EmbeddingKernel, LayerNormKernel, TransposedLinearKernel

    kind = type(kernel)
    if type(module) is nn.Linear or (kind is TransposedLinearKernel and type(module).__name__ == "Conv1D"):
        return kind in (LinearKernel, TransposedLinearKernel)
    if type(module) is nn.LayerNorm:
        return kind is LayerNormKernel
    if type(module) is nn.Embedding:
        return (kind is EmbeddingKernel and not module.sparse and module.max_norm is None
                and not module.scale_grad_by_freq)
    return False


def _hook_param_grads(output: Tensor, module: nn.Module, site: Site, on_grad) -> frozenset:
    """Hook the autograd node(s) of one layer call (``output`` its result) so that
    ``on_grad(site, dL/dp of this call, attr)`` receives each tracked parameter's gradient from
    this call alone (before other uses, regularisers or DDP add to it): a parameter that is a
    direct input of the call's node (:data:`_ROUTED_NODES`; ``weight.t()`` of ``F.linear``
    through its transpose node). Returns the attributes so hooked."""
    fn = output.grad_fn
    if compat.node_name(fn) in ("ViewBackward0", "UnsafeViewBackward0"):
        fn = fn.next_functions[0][0]  # a [B, T, d] input: the 2-D product under a view
    if compat.node_name(fn) not in _ROUTED_NODES:
        return frozenset()
    ids = {id(getattr(module, attr)): attr for attr in site.params}
    direct, hooked = [], []
    for i, (nxt, _) in enumerate(fn.next_functions):
        if nxt is None:
            continue
        attr = ids.get(id(getattr(nxt, "variable", None)))
        if attr is not None:
            direct.append((i, attr))
        elif compat.node_name(nxt) == "TBackward0" and nxt.next_functions:
            attr = ids.get(id(getattr(nxt.next_functions[0][0], "variable", None)))
            if attr is not None:
                hooked.append(attr)
                nxt.register_hook(_node_hook(on_grad, site, ((0, attr),)))
    if direct:
        fn.register_hook(_node_hook(on_grad, site, tuple(direct)))
    return frozenset(hooked) | frozenset(attr for _, attr in direct)


def _node_hook(on_grad, site: Site, slots: tuple):
    """A node hook giving ``on_grad(site, grad_inputs[i], attr)`` for each ``(i, attr)`` of
    ``slots``; it returns None, so the gradients flow on unchanged."""

    def hook(grad_inputs, grad_outputs) -> None:
        for i, attr in slots:
            on_grad(site, grad_inputs[i], attr)

    return hook
