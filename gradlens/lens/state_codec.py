"""The plain-data codec of the Lens state: a tracked window and a pending record written as
tensors, numbers, strings, bools, None and lists / tuples / dicts of those (what
``torch.load(weights_only=True)`` reads), and rebuilt by constructing gradlens' own state classes
only. Nothing is unpickled: a checkpoint cannot name a function, so loading one runs no code of
its choosing.

A value is written as a *node*:

* ``None``, a bool, int, float or str, a tensor (``torch.Tensor`` or ``nn.Parameter``, on its
  device; copied, so a state is a snapshot): itself;
* a list: a list of nodes; a dict whose keys are all strings: a dict of nodes;
* anything else: a tuple whose first item says what it is:

  - ``("tuple", [nodes])``, ``("set", [nodes])``, ``("frozenset", [nodes])``,
    ``("dict", [[key node, value node], ...])`` (a dict with other keys);
  - ``("dtype", "float32")``, ``("device", "cuda:0")``;
  - ``("ref", kind, name)``: an object of the Lens, by name: ``"p"`` a tracked parameter
    (qualified name), ``"m"`` a module of the model (qualified name), ``"i"`` an instrument
    (its position), ``"pool"`` a pool of reused buffers (:class:`~gradlens.core.stats.Accumulators`);
  - ``("obj", class name, index, {field: node})``: an object of one of the state classes of
    :data:`REGISTRY`, with its fields; ``("same", index)``: that object again (shared objects
    stay shared, as in the window).

:data:`REGISTRY` is the explicit list of the classes a state may hold, each with the fields it
is written with and how it is rebuilt from them (its own constructor). A site's kernel is
written by its class name and rebuilt as a gradlens kernel of that class, or, for a kernel
registered for the site's module (:func:`gradlens.register_kernel`), as the one
:func:`gradlens.capture.registry.kernel_for` gives that module. Anything else (another class, a
function, an object of a user's instrument) is refused with a :class:`StateDictError`: when
saved, naming where it sits and the fix; when loaded, before anything of the state is applied.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn

from gradlens import kernels as K
from gradlens.capture import Site
from gradlens.capture.registry import kernel_for, qualname
from gradlens.compat import tensor_version
from gradlens.core.records import Hist1d, Hist2d, Record, TensorSummary
from gradlens.core.state_checks import StateDictError
from gradlens.core.stats import Accumulators, WindowStats
from gradlens.instruments.crosssample import _DotState, _Layer, _Part
from gradlens.instruments.curvature import _CurvState
from gradlens.instruments.hist import _Hist1dState
from gradlens.instruments.hist2d import _Hist2dState, _Theta
from gradlens.instruments.sampling import Stratum
from gradlens.instruments.tests import ShiftedMoments
from gradlens.instruments.trajectory import SquaredNorms
from gradlens.instruments.accumulation import CheckState

__all__ = ["REGISTRY", "Decoder", "Encoder", "StateClass"]

#: the pools of reused buffers a state may refer to (``Lens._pools``' keys)
POOLS = ("sum_grad_squared", "grad_sum")

#: tensor types written as themselves (a subclass such as a DTensor is refused: it would need
#: code of its own to load)
_TENSORS = (Tensor, nn.Parameter)
_SCALARS = (bool, int, float, str)


@dataclass(frozen=True)
class StateClass:
    """One class a Lens state may hold (:data:`REGISTRY`).

    Attributes:
        cls: the class (matched exactly, not its subclasses).
        fields: the names under which an object is written.
        read: ``(obj, encoder) -> {field: value}`` (None: ``getattr`` of each field; then the
            object's attributes must be ``fields`` and ``skip``, so that a field added to the
            class and not here is caught, not dropped).
        build: ``{field: value} -> obj``, the class's own constructor (None: ``cls(**fields)``).
        skip: attributes not written (caches, formed again on demand).
    """

    cls: type
    fields: tuple[str, ...]
    read: Callable[[Any, "Encoder"], dict] | None = None
    build: Callable[[dict], Any] | None = None
    skip: tuple[str, ...] = ()


def _dataclass(cls: type, skip: tuple[str, ...] = (), read=None, build=None) -> StateClass:
    return StateClass(cls, tuple(f.name for f in dataclasses.fields(cls) if f.name not in skip), read, build, skip)


# ---------------------------------------------------------------------------- kernels and sites
#: gradlens' kernels that take no arguments: written by class name, rebuilt by calling the class
_KERNELS = {
    cls.__name__: cls
    for cls in (
        K.LinearKernel, K.VmapConvKernel, K.Conv2dKernel, K.BatchNormEvalKernel, K.EmbeddingKernel,
        K.LayerNormKernel, K.RMSNormKernel, K.GroupNormKernel, K.InstanceNormKernel,
        K.BatchNormBatchStatsKernel, K.TransposedLinearKernel, K.MaterialisedKernel,
    )
}

#: gradlens' own kernel classes -> the names a state writes them by
_KERNEL_NAMES = {cls: name for name, cls in _KERNELS.items()}


def _read_site(site: Site, enc: "Encoder") -> dict:
    kernel = site.kernel
    own = _KERNEL_NAMES.get(type(kernel))
    if own is not None and not vars(kernel):
        name = own
    elif id(site.module) in enc.refs and type(kernel_for(site.module)) is type(kernel):
        name = qualname(type(kernel))  # the module's registered kernel (a user's, BackPACK's)
    else:
        raise enc.refuse(kernel, "a kernel that is neither gradlens' own nor the one registered for its module")
    return {"name": site.name, "module": site.module, "kernel": name, "params": site.params}


def _build_site(f: dict) -> Site:
    module, name = f["module"], f["kernel"]
    if not (isinstance(f["name"], str) and isinstance(name, str) and isinstance(f["params"], dict)
            and all(isinstance(k, str) and isinstance(q, str) for k, q in f["params"].items())):
        raise ValueError("a site's name, kernel and parameters are strings")
    if not isinstance(module, (nn.Module, K.OpLinear, K.Materialised)):
        raise ValueError(f"a site's module is a {type(module).__name__}")
    if name in _KERNELS:
        kernel = _KERNELS[name]()
    else:
        kernel = kernel_for(module) if isinstance(module, nn.Module) else None
        if kernel is None or qualname(type(kernel)) != name:
            raise ValueError(
                f"the kernel {name!r} of use {f['name']!r} is not gradlens' own nor the one registered for its "
                "module in this process (register it with gradlens.register_kernel before loading)"
            )
    return Site(f["name"], module, kernel, dict(f["params"]))


def _build_op_linear(f: dict) -> K.OpLinear:
    if not (isinstance(f["weight"], Tensor) and (f["bias"] is None or isinstance(f["bias"], Tensor))
            and isinstance(f["tracked"], tuple) and all(a in ("weight", "bias") for a in f["tracked"])):
        raise ValueError("an F.linear use holds a weight tensor, a bias tensor or None, and its tracked attributes")
    return K.OpLinear(f["weight"], f["bias"], f["tracked"])


def _build_materialised(f: dict) -> K.Materialised:
    if not (isinstance(f["attr"], str) and f["attr"].isidentifier() and isinstance(f["param"], Tensor)):
        raise ValueError("a materialised use holds an attribute name and a parameter")
    return K.Materialised(f["attr"], f["param"])


# ---------------------------------------------------------------------------- window states
def _read_layer(lay: _Layer, enc: "Encoder") -> dict:
    # the version counters of a and delta (in-place changes are refused at the window's end)
    # restart in a reloaded tensor: the state says whether they were intact when saved
    intact = (tensor_version(lay.a), tensor_version(lay.delta)) == lay.versions
    return {"w": lay.w, "a": lay.a, "delta": lay.delta, "intact": intact, "gram": lay.gram, "scale": lay.scale}


def _build_layer(f: dict) -> _Layer:
    a, delta = f["a"], f["delta"]
    if not (isinstance(a, Tensor) and isinstance(delta, Tensor) and isinstance(f["intact"], bool)):
        raise ValueError("a kept layer holds its input and output gradient tensors")
    versions = (tensor_version(a), tensor_version(delta)) if f["intact"] else (-1, -1)
    return _Layer(f["w"], a, delta, versions, gram=f["gram"], scale=f["scale"])


def _read_curv(state: _CurvState, enc: "Encoder") -> dict:
    if state.graph is not None and state.graph.grad:
        raise RuntimeError(
            "Lens.state_dict() was called inside a tracked window of a curvature instrument "
            "(HessMaxEV, HessTrace, TICDiag, TICTrace) after some of its micro-steps: their "
            "autograd graphs cannot be saved; call it between windows (after optimizer.step())"
        )
    return {"done": state.done, "value": state.value, "extra": state.extra, "meta": state.meta}


def _build_stratum(f: dict) -> Stratum:
    sizes, table = [f[k] for k in ("m", "numel", "cells", "width")], f["table"]
    if not (all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in sizes) and isinstance(table, Tensor)):
        raise ValueError("a sampled stratum holds four counts and its table")
    out = Stratum(*sizes, table.device)
    out.table = table
    return out


def _build_accumulators(f: dict) -> Accumulators:
    if not (f["pool"] is None or isinstance(f["pool"], dict)) or not isinstance(f["sums"], dict):
        raise ValueError("window sums hold a pool and a dict of sums")
    out = Accumulators(f["pool"])
    out.update(f["sums"])
    return out


#: every class a Lens state may hold, by the name it is written under
REGISTRY: dict[str, StateClass] = {
    "WindowStats": _dataclass(WindowStats, skip=("_memo", "_gradlens_cross_memo", "micro_ranks")),
    "Accumulators": StateClass(Accumulators, ("pool", "sums"), read=lambda a, enc: {"pool": a.pool, "sums": dict(a)},
                               build=_build_accumulators),
    "Record": _dataclass(Record),
    "Hist1d": _dataclass(Hist1d),
    "Hist2d": _dataclass(Hist2d),
    "TensorSummary": _dataclass(TensorSummary),
    "Site": StateClass(Site, ("name", "module", "kernel", "params"), read=_read_site, build=_build_site),
    "OpLinear": StateClass(K.OpLinear, ("weight", "bias", "tracked"),
                           read=lambda m, enc: {"weight": m.weight, "bias": m.bias, "tracked": tuple(m._tracked)},
                           build=_build_op_linear),
    "Materialised": StateClass(K.Materialised, ("attr", "param"),
                               read=lambda m, enc: {"attr": m._attr, "param": getattr(m, m._attr)},
                               build=_build_materialised),
    "_DotState": _dataclass(_DotState),
    "_Part": _dataclass(_Part),
    "_Layer": StateClass(_Layer, ("w", "a", "delta", "intact", "gram", "scale"), read=_read_layer,
                         build=_build_layer),
    "_Hist1dState": _dataclass(_Hist1dState),
    "_Hist2dState": _dataclass(_Hist2dState),
    "_Theta": _dataclass(_Theta),
    "Stratum": StateClass(Stratum, ("m", "numel", "cells", "width", "table"), build=_build_stratum),
    "ShiftedMoments": _dataclass(ShiftedMoments),
    "SquaredNorms": _dataclass(SquaredNorms, skip=("presented",)),  # transient: values handed over in one call
    "CheckState": _dataclass(CheckState),
    "_CurvState": _dataclass(_CurvState, skip=("graph",), read=_read_curv),
}
_BY_CLASS = {entry.cls: name for name, entry in REGISTRY.items()}


def _object_refs(lens: "Lens") -> list[tuple[Any, tuple]]:
    """The Lens' objects a state refers to by name, ``[(obj, ("ref", kind, name))]``."""
    pairs = [(pool, ("ref", "pool", name)) for name, pool in lens._pools.items() if name in POOLS]
    pairs += [(p, ("ref", "p", q)) for q, p in lens._tap.params.items()]
    pairs += [(m, ("ref", "m", n)) for n, m in lens.model.named_modules()]
    pairs += [(i, ("ref", "i", n)) for n, i in enumerate(lens.instruments)]
    return pairs


# ---------------------------------------------------------------------------- writing
class Encoder:
    """Writes the values of one Lens state as nodes (module docstring): one encoder per state,
    so that an object met twice (a site kept by the window and by an instrument) is written
    once. Tensors are copied (``copy.deepcopy`` with one memo: views of one tensor stay views)."""

    def __init__(self, lens: "Lens"):
        self.refs = {id(obj): ref for obj, ref in _object_refs(lens)}
        self._memo: dict[int, int] = {}  # id(object) -> index of its "obj" node
        self._busy: set[int] = set()
        self._copies: dict = {}  # deepcopy's memo of the tensors
        self._keep: list = []  # what the memo's ids refer to, alive until the state is written
        self._path: list[str] = []

    def __call__(self, value: Any, where: str) -> Any:
        """``value`` as a node; ``where`` names it in errors (``"the partial window's stats"``)."""
        self._path = [where]
        return self._node(value)

    def refuse(self, value: Any, what: str = "") -> StateDictError:
        """The error for a value a state cannot hold, naming where it sits."""
        kind = what or f"a {type(value).__module__}.{type(value).__qualname__}"
        return StateDictError(
            f"Lens.state_dict(): {''.join(self._path)} is {kind}, which a Lens state does not hold "
            "(plain data: tensors, numbers, strings, bools, None, lists / tuples / dicts / sets of "
            "those, and gradlens' own window classes); an instrument's window state must be made of "
            "those, or call state_dict() between windows (after optimizer.step()), where no window "
            "state is saved"
        )

    def _node(self, v: Any) -> Any:
        t = type(v)
        if v is None or t in _SCALARS:
            return v
        ref = self.refs.get(id(v))
        if ref is not None:
            return ref
        if t in _TENSORS:
            return copy.deepcopy(v, self._copies)
        if t is list:
            return [self._at(f"[{i}]", x) for i, x in enumerate(v)]
        if t is dict:
            if all(type(k) is str for k in v):
                return {k: self._at(f"[{k!r}]", x) for k, x in v.items()}
            return ("dict", [[self._at(f"<key {i}>", k), self._at(f"[{k!r}]", x)] for i, (k, x) in enumerate(v.items())])
        if t in (tuple, set, frozenset):
            return (t.__name__, [self._at(f"[{i}]", x) for i, x in enumerate(v)])
        if t is torch.dtype:
            return ("dtype", str(v).removeprefix("torch."))
        if t is torch.device:
            return ("device", str(v))
        name = _BY_CLASS.get(t)
        if name is None:
            raise self.refuse(v)
        return self._object(name, REGISTRY[name], v)

    def _at(self, step: str, v: Any) -> Any:
        self._path.append(step)
        try:
            return self._node(v)
        finally:
            self._path.pop()

    def _object(self, name: str, entry: StateClass, obj: Any) -> Any:
        key = id(obj)
        if key in self._memo:
            return ("same", self._memo[key])
        if key in self._busy:
            raise self.refuse(obj, f"a {name} that contains itself")
        self._busy.add(key)
        try:
            if entry.read is not None:
                fields = entry.read(obj, self)
            else:
                extra = sorted(set(vars(obj)) - set(entry.fields) - set(entry.skip))
                if extra:  # a field the registry does not know: refused, not dropped
                    raise self.refuse(obj, f"a {name} with attributes {extra} that gradlens' state format does not write")
                fields = {f: getattr(obj, f) for f in entry.fields}
            index = self._memo[key] = len(self._memo)
            self._keep.append(obj)
            return ("obj", name, index, {f: self._at(f".{f}", v) for f, v in fields.items()})
        finally:
            self._busy.discard(key)


# ---------------------------------------------------------------------------- reading
class Decoder:
    """Rebuilds the values :class:`Encoder` wrote, for ``lens``: references resolve to its
    parameters, modules, instruments and buffer pools; tensors are copied (the state dict
    stays as it was); anything but the nodes of the module docstring is refused with a
    :class:`StateDictError` naming where it sits. Building changes nothing of ``lens`` (a
    missing buffer pool is created empty)."""

    def __init__(self, lens: "Lens"):
        self._lens = lens
        self._params = dict(lens._tap.params)
        self._named_modules = dict(lens.model.named_modules())
        self._built: dict[int, Any] = {}
        self._copies: dict = {}
        self._path: list[str] = []

    def __call__(self, node: Any, where: str) -> Any:
        self._path = [where]
        return self._value(node)

    def _error(self, what: str) -> StateDictError:
        return StateDictError(
            f"the Lens state_dict's {''.join(self._path)} {what}; the checkpoint is damaged or was "
            "altered (a Lens state holds plain data only): resume from an earlier one"
        )

    def _value(self, n: Any) -> Any:
        t = type(n)
        if n is None or t in _SCALARS:
            return n
        if t in _TENSORS:
            return copy.deepcopy(n, self._copies)
        if t is list:
            return [self._at(f"[{i}]", x) for i, x in enumerate(n)]
        if t is dict:
            if not all(type(k) is str for k in n):
                raise self._error("is a dict with keys that are not strings")
            return {k: self._at(f"[{k!r}]", x) for k, x in n.items()}
        if t is not tuple:
            raise self._error(f"holds a {t.__module__}.{t.__qualname__}, which a Lens state does not hold")
        tag = n[0] if n and type(n[0]) is str else None
        handler = self._TAGS.get(tag)
        if handler is None:
            raise self._error(f"holds a tuple tagged {n[:1]!r}, which is none of the state's kinds")
        try:
            return handler(self, n)
        except StateDictError:
            raise
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, RuntimeError) as err:
            raise self._error(f"does not rebuild: {tag} {err}") from err

    def _at(self, step: str, n: Any) -> Any:
        self._path.append(step)
        try:
            return self._value(n)
        finally:
            self._path.pop()

    def _items(self, n: tuple) -> list:
        if len(n) != 2 or type(n[1]) is not list:
            raise self._error(f"holds a malformed {n[0]!r} node")
        return [self._at(f"[{i}]", x) for i, x in enumerate(n[1])]

    def _collection(self, n: tuple) -> Any:
        items = self._items(n)
        return {"tuple": tuple, "set": set, "frozenset": frozenset}[n[0]](items)

    def _dict(self, n: tuple) -> dict:
        pairs = self._items(n)
        if not all(type(p) is list and len(p) == 2 for p in pairs):
            raise self._error("holds a dict that is not a list of [key, value] pairs")
        return {k: v for k, v in pairs}

    def _dtype(self, n: tuple) -> torch.dtype:
        dtype = getattr(torch, n[1], None) if len(n) == 2 and type(n[1]) is str and n[1].isidentifier() else None
        if not isinstance(dtype, torch.dtype):
            raise self._error(f"names the dtype {n[1:]!r}, which torch does not have")
        return dtype

    def _device(self, n: tuple) -> torch.device:
        if len(n) != 2 or type(n[1]) is not str:
            raise self._error("holds a malformed device")
        return torch.device(n[1])

    def _ref(self, n: tuple) -> Any:
        kind, name = (n[1], n[2]) if len(n) == 3 else (None, None)
        lens = self._lens
        if kind == "p" and name in self._params:
            return self._params[name]
        if kind == "m" and name in self._named_modules:
            return self._named_modules[name]
        if kind == "i" and type(name) is int and 0 <= name < len(lens.instruments):
            return lens.instruments[name]
        if kind == "pool" and name in POOLS:
            return lens._pools.setdefault(name, {})
        what = {"p": "parameter", "m": "module", "i": "instrument", "pool": "buffer pool"}.get(kind, repr(kind))
        raise StateDictError(
            f"the Lens state_dict refers to {what} {name!r}, which this Lens does not have; build it "
            "on the same model with the same instruments (in the same order) and exclusions"
        )

    def _object(self, n: tuple) -> Any:
        if len(n) != 4 or type(n[1]) is not str or type(n[2]) is not int or type(n[3]) is not dict:
            raise self._error("holds a malformed object node")
        _, name, index, raw = n
        entry = REGISTRY.get(name)
        if entry is None:
            raise self._error(f"holds an object of class {name!r}, which is not one of gradlens' state classes")
        if index in self._built:
            raise self._error(f"holds object {index} twice")
        if set(raw) != set(entry.fields):
            raise self._error(f"holds a {name} with fields {sorted(raw)}, not {sorted(entry.fields)}")
        fields = {f: self._at(f".{f}", raw[f]) for f in entry.fields}
        obj = entry.build(fields) if entry.build is not None else entry.cls(**fields)
        self._built[index] = obj
        return obj

    def _same(self, n: tuple) -> Any:
        if len(n) != 2 or type(n[1]) is not int or n[1] not in self._built:
            raise self._error("refers to an object that comes later or not at all")
        return self._built[n[1]]

    _TAGS: dict[str, Callable[["Decoder", tuple], Any]] = {
        "tuple": _collection, "set": _collection, "frozenset": _collection, "dict": _dict,
        "dtype": _dtype, "device": _device, "ref": _ref, "obj": _object, "same": _same,
    }


def is_plain(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is plain data (None, bool, int, float, str, a tensor, and lists /
    tuples / dicts with string or int keys of those): what an instrument's ``state_dict()``
    holds. Checked before an instrument sees a loaded state, so that no other object reaches
    its ``load_state_dict``."""
    t = type(value)
    if value is None or t in _SCALARS or t in _TENSORS:
        return True
    if depth > 64:
        return False
    if t in (list, tuple):
        return all(is_plain(v, depth + 1) for v in value)
    if t is dict:
        return all(type(k) in (str, int) and is_plain(v, depth + 1) for k, v in value.items())
    return False

