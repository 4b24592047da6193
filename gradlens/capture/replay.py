"""A tracked forward planned once (:class:`Replay`): the first tracked forward of each
micro-batch size runs under the capture's ``TorchFunctionMode`` and records a :class:`Plan`
(which closed-form sites are used, in what order, on which inputs, and the sample axis the mode
found for each); later forwards of that size run without the mode, the site hooks alone
checking each use against the plan (docs/design.md, "Planned forwards").

What the module hooks cannot see, the functional code between two sites, is read from the
autograd graph instead: a site's input is described by its **signature**, the graph of
autograd nodes that made it (each node's class and what it saved: dims, sizes, shapes of saved
tensors) down to **frontier** tensors whose sample axis is known (the model's inputs, the
inputs and outputs of the sites used before it). The axis the mode found for a signature is the
axis any tensor of that signature has: the mode's rules read the functions, their plain
arguments and shapes, and the axes of their data arguments, all of which the signature fixes.
A node whose saved index tensor could move rows along an unnamed dim (``h[idx]``, ``take``),
a Python ``autograd.Function`` and a tensor without gradient made by code the plan cannot see
have no signature: such a plan is not kept, and such a use in a replayed forward leaves it."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from gradlens import compat
from gradlens.capture.marks import _tensors

__all__ = ["Plan", "Replay", "DERIVED"]

#: the plan's axis of a site input computed from parameters (and constants) only
DERIVED = "derived"
_MISSING = object()

#: nodes whose saved integer or boolean tensor does not move rows (a mask applied elementwise,
#: a pooling's argmax inside each (sample, channel)); nodes that save a ``dim`` move rows along
#: that dim only, which the signature names
_MASKS = frozenset({
    "WhereBackward0", "MaskedFillBackward0", "MaskedFillBackward1", "NativeDropoutBackward0",
    "MaxPool1DWithIndicesBackward0", "MaxPool2DWithIndicesBackward0", "MaxPool3DWithIndicesBackward0",
    "AdaptiveMaxPool1DBackward0", "AdaptiveMaxPool2DBackward0", "AdaptiveMaxPool3DBackward0",
})


#: where a replayed forward lost the sample axis of a site input (for the site's error)
_UNPLANNED = ("operations between layers that a forward replayed from its plan did not follow (a branch "
              "the first tracked forward of this micro-batch size did not take); set "
              "gradlens.capture.replay.Replay.enabled = False to follow every forward")


#: autograd nodes of elementwise operations (each output element from the same element of
#: its inputs, broadcast): they keep every row of a tensor where it is
_POINTWISE = frozenset(f"{n}Backward{v}" for n, v in (
    ("Add", 0), ("Add", 1), ("Sub", 0), ("Sub", 1), ("Mul", 0), ("Mul", 1), ("Div", 0), ("Div", 1), ("Neg", 0),
    ("Tanh", 0), ("Relu", 0), ("Gelu", 0), ("Sigmoid", 0), ("Silu", 0), ("Mish", 0), ("Elu", 0), ("LeakyRelu", 0),
    ("Hardtanh", 0), ("Softplus", 0), ("Exp", 0), ("Log", 0), ("Sqrt", 0), ("Rsqrt", 0), ("Abs", 0), ("Pow", 0),
    ("Pow", 1), ("Clone", 0), ("ToCopy", 0), ("NativeDropout", 0), ("Where", 0), ("MaskedFill", 0),
    ("MaskedFill", 1), ("Sin", 0), ("Cos", 0), ("Reciprocal", 0), ("Clamp", 0), ("Clamp", 1), ("ClampMin", 0),
    ("Hardswish", 0), ("Hardsigmoid", 0), ("Lerp", 0), ("Lerp", 1), ("Addcmul", 0), ("Addcdiv", 0),
))


class _Unknown(Exception):
    """A node or tensor the plan cannot describe."""


class Plan:
    """What the mode found in one tracked forward of one micro-batch size: ``entries``, the
    site calls in order as ``(module, signature of its input)``; ``axes``, signature -> the
    sample axis ``(dim, 1)`` (or :data:`DERIVED`) of every site input and returned tensor;
    ``uses``: the parameter uses it counted."""

    __slots__ = ("entries", "axes", "uses")

    def __init__(self) -> None:
        self.entries: list[tuple[nn.Module, tuple]] = []
        self.axes: dict[tuple, Any] = {}
        self.uses = 0


class Replay:
    """The plans of a :class:`~gradlens.capture.tap.Tap` and the state of the forward that
    runs now (``state``: ``"record"`` under the mode, ``"replay"`` without it, ``"general"``
    once a replayed forward left its plan and the mode took over, None: the mode, nothing
    recorded).

    Class attributes: ``enabled`` (off by default: replayed forwards are not faster yet, see
    docs/design.md "Planned forwards"; False: every tracked forward runs under the mode), ``verify_every`` (every so many tracked forwards run under the mode and record
    their plan again), ``retry`` (a forward whose plan could not be kept is recorded again
    after so many tracked forwards), ``max_plans`` (micro-batch sizes kept)."""

    enabled = False
    verify_every = 16
    retry = 16
    max_plans = 32

    def __init__(self) -> None:
        self.plans: dict[int, Plan] = {}
        self.next_try: dict[int, int] = {}
        self.count = 0
        self.state: str | None = None
        self.replayed = 0  # forwards replayed (for tests and logs)
        self._forward_clear()

    def reset(self) -> None:
        """Forget every plan (the tracked parameters changed)."""
        self.plans.clear()
        self.next_try.clear()
        self.state = None
        self._forward_clear()

    def _forward_clear(self) -> None:
        self.front_t: dict[int, tuple] = {}  # id -> (tensor, leaf, version): tensors without a node
        self.front_n: dict = {}  # node -> leaf (output 0) or {output_nr: leaf}
        self.pos = 0
        self.rec: Plan | None = None
        self.plan: Plan | None = None
        self.key: tuple | None = None  # (micro-batch size, input shapes and dtypes)
        self.base: tuple = ()

    # ------------------------------------------------------------------ a forward
    def begin(self, tap: Any, inputs: tuple, packed: bool) -> bool:
        """A tracked forward opens (its inputs already marked): True if it is replayed (the
        mode stays off). ``packed``: not planned (packed sequences, a submodule called on its
        own)."""
        self._forward_clear()
        self.state = None
        batch = tap._batch
        if not self.enabled or batch is None or packed:
            return False
        self.count += 1
        tensors = list(_tensors(inputs))
        key = (batch,) + tuple((tuple(x.shape), x.dtype) for _, x in tensors)  # one plan per input shapes
        plan = self.plans.get(key)
        if plan is not None and self.count % self.verify_every:
            self.state, self.plan = "replay", plan
            self.replayed += 1
        elif self.next_try.get(key, 0) <= self.count:
            self.state, self.rec = "record", Plan()
            self.base = (sum(tap.uses.values()), tap._ops, len(tap.tainted), len(tap.axis_errors),
                         _live(tap._pooled), _live(tap._coupled))
        else:
            return False
        self.key = key
        data = tap._data
        for _, x in tensors:
            ax = data.get(x, _MISSING)
            if ax is _MISSING:
                self._front(x, ("const", tuple(x.shape), x.dtype))
            elif type(ax) is tuple and ax[1] == 1:
                self._front(x, ("in", ax, tuple(x.shape), x.dtype))
            else:  # (rows of a sample moved: not planned)
                self.state, self.rec, self.plan = None, None, None
                return False
        return self.state == "replay"

    def end(self, tap: Any, outs: list) -> None:
        """The forward returns ``outs``: a recorded plan is kept if every use was a plain site
        use; a replayed forward checks that it used every site of its plan and that what it
        returns has a known axis (marked for the loss), else refuses it."""
        state, self.state = self.state, None
        try:
            if state == "record":
                self._keep(tap, outs)
            elif state in ("replay", "general"):
                if state == "replay" and self.pos != len(self.plan.entries):
                    self.plans.pop(self.key, None)  # fewer uses than planned: recorded again next time
                self._returned(tap, outs)
        finally:
            self._forward_clear()

    def _keep(self, tap: Any, outs: list) -> None:
        rec, base = self.rec, self.base
        ok = rec is not None and (sum(tap.uses.values()) - base[0] == rec.uses and tap._ops == base[1]
              and len(tap.tainted) == base[2] and len(tap.axis_errors) == base[3]
              and not tap.chain.calls and _live(tap._pooled) <= base[4] and _live(tap._coupled) <= base[5])
        if ok:
            for o in outs:
                if isinstance(o, Tensor) and o.requires_grad:
                    ax = tap._data.get(o, DERIVED)
                    if not (ax is DERIVED or (type(ax) is tuple and ax[1] == 1)) or not self._note_axis(rec, o, ax):
                        ok = False
                        break
        if ok:
            if len(self.plans) >= self.max_plans and self.key not in self.plans:
                self.plans.pop(next(iter(self.plans)))
            self.plans[self.key] = rec
        else:
            self.plans.pop(self.key, None)
            self.next_try[self.key] = self.count + self.retry

    def _returned(self, tap: Any, outs: list) -> None:
        if tap.chain.calls:
            tap._refuse_axis(None, "a loss computed inside a forward replayed from its plan (a branch the first "
                             "tracked forward of this micro-batch size did not take); set "
                             "gradlens.capture.replay.Replay.enabled = False to follow every forward",
                             tuple(tap.params))
        data = tap._data
        for o in outs:
            if not (isinstance(o, Tensor) and o.requires_grad) or o in data or o in tap._derived:
                continue
            ax = self._lookup(o)
            if ax is _MISSING:
                ax = self._pointwise(o)
            if ax is DERIVED:
                tap._derived[o] = frozenset()
            elif ax is not _MISSING:
                data[o] = ax
            else:
                tap._refuse_axis(
                    o, f"the output of shape {tuple(o.shape)} of a forward replayed from its plan: the operations "
                    "after its last layer are not those the plan knows (a branch the first tracked forward of "
                    "this micro-batch size did not take); set gradlens.capture.replay.Replay.enabled = False to "
                    "follow every forward", tuple(tap.params))

    # ------------------------------------------------------------------ a site use
    def note(self, tap: Any, module: nn.Module, a: Tensor, ax: Any, output: Tensor, uses: int) -> None:
        """A site use (``ax``: its input's axis as the mode found it, or :data:`DERIVED`) in a
        recorded forward; ``uses``: the parameter uses it counts."""
        rec = self.rec
        if rec is None:
            return
        if tap._ops != self.base[1] or not (ax is DERIVED or (type(ax) is tuple and ax[1] == 1)):
            self.rec = None  # rows moved or the samples as a factor: no plan
            return
        with compat.no_torch_function():
            s = self.signature(a, tap)
            if s is None or not self._note_axis(rec, a, ax, s):
                self.rec = None
                return
            rec.entries.append((module, s))
            rec.uses += uses
            self._after(a, ax, output)

    def _note_axis(self, rec: Plan, x: Tensor, ax: Any, s: tuple | None = None) -> bool:
        if s is None:
            s = self.signature(x, None)
            if s is None:
                return False
        return rec.axes.setdefault(s, ax) == ax  # (one signature, one axis: else the plan is not kept)

    def replay_use(self, tap: Any, module: nn.Module, a: Tensor, output: Tensor) -> None:
        """A site use in a replayed forward: its input checked against the plan (the next
        site, the same signature) and marked with the plan's axis. A use the plan does not
        expect switches the rest of the forward to the mode (:meth:`leave`); its own input
        keeps the axis of its signature if the plan knows it, else stays unknown (refused)."""
        with compat.no_torch_function():
            data = tap._data
            if self.state == "general":
                known = data.get(a, None)
                if known is not None or a in tap._derived:
                    self._after(a, DERIVED if known is None else known, output)
                    return
            s = self.signature(a, tap)
            if self.state == "replay":
                entries = self.plan.entries
                e = entries[self.pos] if self.pos < len(entries) else None
                if e is not None and e[0] is module and e[1] == s:
                    self.pos += 1
                else:
                    self.leave(tap)
            ax = self.plan.axes.get(s, _MISSING) if s is not None else _MISSING
            if ax is _MISSING:
                ax = self._pointwise(a)
            if ax is _MISSING:
                if a.requires_grad and a not in data:  # refused by the site hook, saying why
                    data[a] = None
                    tap._lost[a] = _UNPLANNED
                return
            if ax is DERIVED:
                if a.requires_grad:
                    tap._derived[a] = tap._derived.get(a, frozenset())
            else:
                data[a] = ax
            self._after(a, ax, output)

    def leave(self, tap: Any) -> None:
        """A replayed forward departs from its plan: the mode follows the rest of it (back on
        the torch-function stack when the site being run returns), the plan of this size is
        recorded again next time."""
        self.state = "general"
        self.plans.pop(self.key, None)
        tap._mode_out = True  # the site's post-hook puts the mode on

    def leave_now(self, tap: Any) -> None:
        """:meth:`leave` outside a site's call (a module whose tracked-window forward uses its
        parameters through the mode: attention, RNNs): the mode goes on at once."""
        if self.state == "replay":
            self.state = "general"
            self.plans.pop(self.key, None)
            if not tap._skip and not tap._mode_out:
                tap._mode.__enter__()
            else:
                tap._mode_out = True

    def _after(self, a: Tensor, ax: Any, output: Tensor) -> None:
        """The input and output of a site call join the frontier."""
        self._front(a, _leaf(a, ax))
        out_ax = ax if ax is DERIVED or output.dim() >= a.dim() else None
        self._front(output, _leaf(output, out_ax))

    def _front(self, x: Tensor, leaf: tuple) -> None:
        node = x.grad_fn
        if node is not None:
            nr = x.output_nr
            if nr == 0 and node not in self.front_n:
                self.front_n[node] = leaf
            else:
                got = self.front_n.get(node)
                outs = got if type(got) is dict else ({} if got is None else {0: got})
                outs[nr] = leaf
                self.front_n[node] = outs
        else:
            self.front_t[id(x)] = (x, leaf, compat.tensor_version(x))

    def _lookup(self, x: Tensor) -> Any:
        with compat.no_torch_function():
            s = self.signature(x, None)
        return self.plan.axes.get(s, _MISSING) if s is not None and self.plan is not None else _MISSING

    def _pointwise(self, x: Tensor) -> Any:
        """The axis of ``x`` that the plan does not know, where every operation between it and
        the frontier is elementwise (:data:`_POINTWISE`) and every frontier tensor it reaches
        has ``x``'s shape and one common axis (elementwise operations on tensors of one
        shape keep each row where it is); else unknown."""
        node = x.grad_fn
        if node is None:
            return _MISSING
        shape = (tuple(x.shape), x.dtype)
        found = set()
        stack, seen = [(node, x.output_nr)], set()
        with compat.no_torch_function():
            while stack:
                n, nr = stack.pop()
                leaf = _at(self.front_n.get(n), nr)
                if leaf is None and compat.node_name(n) == "AccumulateGrad":
                    e = self.front_t.get(id(n.variable))
                    leaf = e[1] if e is not None and e[0] is n.variable else None
                    if leaf is None:
                        return _MISSING
                if leaf is not None:
                    if leaf[0] not in ("site", "in") or leaf[1] is DERIVED or leaf[1] is None \
                            or (leaf[2], leaf[3]) != shape:
                        return _MISSING
                    found.add(leaf[1])
                    continue
                if n in seen:
                    continue
                seen.add(n)
                if not compat.is_builtin_node(n) or compat.node_name(n) not in _POINTWISE:
                    return _MISSING
                stack.extend((m, i) for m, i in n.next_functions if m is not None)
        return found.pop() if len(found) == 1 else _MISSING

    # ------------------------------------------------------------------ signatures
    def signature(self, x: Tensor, tap: Any) -> tuple | None:
        """The signature of ``x`` (see the module's docstring), or None where the plan cannot
        describe it."""
        try:
            return self._sig_tensor(x, {})
        except (_Unknown, RecursionError):
            return None

    def _sig_tensor(self, x: Tensor, seen: dict) -> tuple:
        e = self.front_t.get(id(x))
        if e is not None and e[0] is x:
            return ("F", e[1], compat.tensor_version(x) - e[2])
        node = x.grad_fn
        if node is None:
            base = compat.view_base(x)
            e = self.front_t.get(id(base)) if base is not None else None
            if e is not None and e[0] is base:  # a view of a frontier tensor without gradient (x.flatten(1))
                return ("V", e[1], compat.tensor_version(base) - e[2], tuple(x.shape), x.stride(), x.storage_offset())
            raise _Unknown  # made without gradient by code the plan cannot see
        return ("G", tuple(x.shape), x.dtype, self._sig_node(node, x.output_nr, seen))

    def _sig_node(self, node: Any, nr: int, seen: dict) -> tuple:
        leaf = self.front_n.get(node)
        if leaf is not None:
            leaf = _at(leaf, nr)
            if leaf is not None:
                return ("F", leaf)
        k = seen.get(node)
        if k is not None:
            return ("R", k, nr)
        seen[node] = len(seen)
        cls = type(node)
        kind = _KIND.get(cls)
        if kind is None:
            kind = _kind(node)
        if kind is _UNKNOWN:
            raise _Unknown
        if kind is _ACCUMULATE:
            v = node.variable
            e = self.front_t.get(id(v))
            if e is not None and e[0] is v:
                return ("F", e[1], compat.tensor_version(v) - e[2])
            return ("L", id(v), tuple(v.shape))  # a parameter used between sites, or a leaf input
        saved = ()
        if kind is not _POINTWISE_KIND:  # (an elementwise node moves no row: its class says all)
            names = _NAMES.get(cls)
            if names is None:
                names = _names(node)
            saved = []
            dims = None
            for key, v in compat.node_saved(node, names):
                if key == "dim":
                    dims = v
                saved.append((key, _value(v)))
            for key, v in saved:  # an index without a dim it moves rows along: not described
                if type(v) is tuple and v[:1] == ("I",) and dims is None and kind is not _MASK_KIND:
                    raise _Unknown
            saved = tuple(saved)
        kids = []
        front = self.front_n
        for n, i in node.next_functions:
            if n is None:
                kids.append(None)
                continue
            leaf = front.get(n)  # (the frontier and repeats inline: most edges end there)
            if leaf is not None and (i == 0 or type(leaf) is dict) and (leaf := _at(leaf, i)) is not None:
                kids.append(("F", leaf))
            elif n in seen:
                kids.append(("R", seen[n], i))
            else:
                kids.append(self._sig_node(n, i, seen))
        return (cls, nr, saved, tuple(kids))


#: autograd node class -> the saved values a signature reads (see :func:`_names`)
_NAMES: dict = {}


def _names(node: Any) -> tuple:
    """The saved values of a node class that a signature reads: its arguments (dims, sizes,
    flags) and integer or boolean tensors (indices, masks), not the floating-point tensors it
    keeps for the backward formula (their shapes follow from the nodes around them), which
    are slow to read."""
    keep = tuple(k for k, v in compat.node_saved(node)
                 if not (isinstance(v, Tensor) and (v.is_floating_point() or v.is_complex())))
    _NAMES[type(node)] = keep
    return keep


#: autograd node class -> what a signature makes of it (see :func:`_kind`)
_KIND: dict = {}
_UNKNOWN, _ACCUMULATE, _POINTWISE_KIND, _MASK_KIND, _OTHER = "unknown", "accumulate", "pointwise", "mask", "other"


def _kind(node: Any) -> str:
    """Whether a node class is not described (a Python ``autograd.Function``, a C++
    extension's), a leaf's, elementwise (:data:`_POINTWISE`), a mask's (:data:`_MASKS`) or
    another of torch's."""
    name = compat.node_name(node)
    if not compat.is_builtin_node(node):
        kind = _UNKNOWN
    elif name == "AccumulateGrad":
        kind = _ACCUMULATE
    elif name in _POINTWISE:
        kind = _POINTWISE_KIND
    elif name in _MASKS:
        kind = _MASK_KIND
    else:
        kind = _OTHER
    _KIND[type(node)] = kind
    return kind


def _value(v: Any) -> Any:
    """A saved value as a signature holds it: tensors by shape and dtype (index tensors marked
    ``"I"``), lists as tuples."""
    t = type(v)
    if t is int or t is bool or v is None:
        return v
    if t is tuple and all(type(y) is int for y in v):
        return v
    if isinstance(v, Tensor):
        if v.is_floating_point() or v.is_complex():
            return ("T", tuple(v.shape), v.dtype)
        return ("I", tuple(v.shape), v.dtype)
    if isinstance(v, (list, tuple)):
        return tuple(_value(y) for y in v)
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, torch.SymInt):
        return int(v)
    return repr(v)


def _at(leaf: Any, nr: int) -> Any:
    """The frontier leaf of output ``nr`` of a node (see :attr:`Replay.front_n`)."""
    if type(leaf) is dict:
        return leaf.get(nr)
    return leaf if nr == 0 else None


def _leaf(x: Tensor, ax: Any) -> tuple:
    return ("site", ax, tuple(x.shape), x.dtype)


def _live(marks: Any) -> int:
    """How many live tensors a :class:`~gradlens.capture.marks._TensorMarks` marks."""
    return sum(1 for e in marks._d.values() if e[0]() is not None)
