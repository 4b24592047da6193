"""The ``TorchFunctionMode`` of a tracked forward (:class:`_UseMode`): it sees every torch call
outside closed-form sites, carries the sample axis from data arguments to outputs, tells tensors
derived from parameters only apart, and hands the calls where tracked parameters meet the batch
to the :class:`~gradlens.capture.tap.Tap`. Its per-function tables are kept across calls: what a
torch function is to the mode (:data:`_KINDS`), and the output axis of calls whose only tensor is
their first argument (:data:`_AXES`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from gradlens.capture import axes, ops, samples
from gradlens.capture.losses import _LOSS_FUNCTIONS, _note_functional_loss
from gradlens.capture.marks import _outputs, _ref
from gradlens.capture.parallel import is_exchange, refuse_exchange
from gradlens.capture.rows import EVENTS, Rows

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

_RULED = axes.RULED | frozenset(samples.TABLE)

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
        more = False  # another data argument ...
        odd = False  # ... with another axis than the first's (or none known)
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
                        lead, more = False, True
                        if e[1] is not fax and (fax is None or e[1] != fax):
                            odd = True
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
                                more = True
                                if e[1] is not fax and (fax is None or e[1] != fax):
                                    odd = True
                        else:
                            items.append(((i, j), y))
                    elif type(y) not in _PLAIN:
                        lead = False
            else:
                lead = False  # an argument of another kind: not kept in the axes' memo
                continue
            for pos, y in items:
                got = tap._not_data(pos, y)
                if got is True:  # data the mode did not see made: its axis is unknown
                    is_data = more = odd = True
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
                        else:
                            more = True
                            if e[1] is not fax and (fax is None or e[1] != fax):
                                odd = True
                        continue
                    got = tap._not_data(k, x)
                    if got is True:
                        is_data = more = odd = True
                    elif got is not None:
                        if tracked is None:
                            tracked = [got]
                        else:
                            tracked.append(got)
        else:
            kwargs = _NO_KWARGS
        grad = torch.is_grad_enabled()  # off: e.g. inside a custom autograd.Function (follow the batch)
        if kind & _IS_BAG and is_data:  # F.embedding_bag of flat ids with offsets: its bags are the samples
            tap._bags(args, kwargs)
            fax = tap._data.get(first) if first is not None else None
        if grad and is_data and kind & _IS_BATCH_NORM:
            training = args[5] if len(args) > 5 else kwargs.get("training", False)
            if training or args[1] is None:
                tap._taint_before(args[0], "F.batch_norm (batch statistics)")
        if is_data and kind & _IS_ROWS and _scalar_index(func, args, data):
            # a parameter's slice picked by an index the batch computed (a routed expert's w[e]):
            # derived from the parameter alone (an untracked one's: a constant to the capture)
            out = func(*args, **kwargs) if kwargs else func(*args)
            if grad:
                names = frozenset().union(*(t[2] for t in tracked)) if tracked is not None else frozenset()
                for o in _outputs(out):
                    if o.requires_grad:
                        tap._derived[o] = names
            return out
        if tracked is None or not grad:
            out = func(*args, **kwargs) if kwargs else func(*args)
            if grad and not is_data:
                # computed from untracked parameters and constants only (an excluded position
                # embedding's lookup): a constant to the capture, not data of an unknown axis
                for o in ([out] if isinstance(out, Tensor) else _outputs(out)):
                    if o.requires_grad:
                        tap._derived[o] = frozenset()
            elif is_data:
                if isinstance(out, Tensor):  # one output: its mark set here
                    batch = tap._batch
                    if fax is None or batch is None:
                        ax = None if batch is None else tap._unknown(func, args, kwargs, out)
                    elif (odd or (more and kind & _IS_CONTRACT)) and not kind & _IS_ROWS:  # several data arguments
                        ax = tap._several(func, args, kwargs, out)
                    elif not kind & _IS_RULED and fax[0] < out.dim() and out.shape == first.shape:
                        ax = fax  # the common case: what axes.carry gives without its rules
                    else:
                        if lead and type(fax) is tuple:  # the answer depends on shapes and plain arguments only
                            ax = _carried(func, args, first, fax, out, batch, kind)
                        else:
                            ax = tap._axes(func, args, kwargs, first, fax, [out], kind)[0]
                        if ax.__class__ in EVENTS or ax is None:
                            ax = tap._settle(ax, func, args, kwargs, first, fax, out)
                    data[id(out)] = (_ref(out), ax)
                    if len(data) > tap._data._limit:
                        tap._data.sweep()
                else:
                    tap._carry(func, args, kwargs, first, fax, out, kind, (odd or (more and kind & _IS_CONTRACT)) and not kind & _IS_ROWS)
                if tap.chain.marks:  # a loss of this forward taken further (``(ce_a + ce_b) / 2``)
                    tap.chain.follow(func, args, kwargs, out)
                if grad and kind & _IS_LOSS:
                    _note_functional_loss(func, kwargs, out, tap._batch, args)
                if tap._coupled._d:
                    tap._couple(func, args, kwargs, out)
                if tap._pairwise._d:
                    tap._pair(func, args, kwargs, out)
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
        tap._carry(func, args, kwargs, first, fax, out, kind, (odd or (more and kind & _IS_CONTRACT)) and not kind & _IS_ROWS)
        tap._meet(func, saved, kwargs, tracked, out)
        if tap.chain.marks:
            tap.chain.follow(func, args, kwargs, out)
        if tap._coupled._d:
            tap._couple(func, args, kwargs, out)
        if tap._pairwise._d:
            tap._pair(func, args, kwargs, out)
        return out


#: indexing calls whose index may be a 0-dim tensor (see :func:`_scalar_index`)
_PICKS = frozenset({"__getitem__", "index_select"})


def _scalar_index(func, args: tuple, data: dict) -> bool:
    """Whether the only data arguments of an indexing call on a parameter are 0-dim integer
    tensors (a routed expert's weight ``w[e]``, ``e`` from the batch's routing, in a loop over
    the experts): no sample has an axis there, nothing flows back through the index, and the
    slice is the same for every sample of the micro-batch, so it is derived from the parameter
    alone (its uses are then measured where it meets the samples). An index with more than one
    element picks rows per data row (``w[expert_ids]``): that is a use, followed by its rows."""
    if getattr(func, "__name__", "") not in _PICKS:
        return False
    found = False
    for x in args:
        for y in (x if isinstance(x, (tuple, list)) else (x,)):
            if isinstance(y, Tensor):
                e = data.get(id(y))
                if e is not None and e[0]() is y:
                    if y.dim() != 0 or y.is_floating_point() or y.is_complex() or y.requires_grad:
                        return False
                    found = True
    return found


#: what the mode needs to know of a torch function besides its arguments, as bit flags (one
#: dict read per call): its sample-axis rule is not the default one, it is a loss, F.batch_norm,
#: F.linear, it may reorder, mix or pool the samples (:data:`gradlens.capture.samples.TABLE`), it is
#: a product whose data arguments' dims do not line up elementwise, F.embedding_bag
_IS_RULED, _IS_LOSS, _IS_BATCH_NORM, _IS_LINEAR, _IS_SAMPLES, _IS_CONTRACT, _IS_BAG, _IS_ROWS = 1, 2, 4, 8, 16, 32, 64, 128
_KINDS: dict = {}
_NO_KWARGS: dict = {}  # (never written)


def _kind(func) -> int:
    """:data:`_KINDS` of ``func``, computed on its first call."""
    name = getattr(func, "__name__", "")
    if is_exchange(func):  # expert parallelism: refused on every call (never kept in _KINDS)
        refuse_exchange(func, "the model")
    kind = ((_IS_RULED if name in _RULED else 0)
            | (_IS_LOSS if func in _LOSS_FUNCTIONS else 0)
            | (_IS_BATCH_NORM if func is F.batch_norm else 0) | (_IS_LINEAR if func is F.linear else 0)
            | (_IS_SAMPLES if name in samples.TABLE else 0) | (_IS_CONTRACT if name in samples.CONTRACTIONS else 0)
            | (_IS_BAG if func is F.embedding_bag else 0) | (_IS_ROWS if name in samples.ROWS else 0))
    if len(_KINDS) > 4096:
        _KINDS.clear()
    _KINDS[func] = kind
    return kind


#: (func, axis, batch, input shape, output shape, other arguments) -> the output's axis, for the
#: calls whose only tensor is their first argument and whose other arguments are plain values
#: (a view, transpose, slice of the data): the memo holds no tensor and no object of the model
#: (an answer that holds a tensor, the rows of a :class:`~gradlens.capture.rows.Rows` axis, is
#: not kept)
_AXES: dict = {}


def _carried(func, args: tuple, x: Tensor, ax, out: Tensor, batch: int, kind: int = 0):
    """``axes.carry`` of a call whose only tensor argument is ``x = args[0]`` (and, for the
    functions of :data:`gradlens.capture.samples.TABLE`, what it does to the samples): its rule
    reads the shapes, the axis, the batch size and the other (plain) arguments alone, so the
    answer is kept per such key (a forward repeats the same calls layer after layer and step
    after step)."""
    try:
        key = (func, ax, batch, x.shape, out.shape, args[1:])
        got = _AXES.get(key, _AXES)
    except TypeError:  # an unhashable argument (a slice, before Python 3.12)
        key, got = None, _AXES
    if got is _AXES:
        got = axes.carry(func, args, _NO_KWARGS, x, ax, [out], batch)
        if kind & _IS_SAMPLES:
            got = samples.follow(func, args, _NO_KWARGS, x, ax, [out], batch, got)
        got = got[0]
        if key is not None and type(got) is not Rows:
            if len(_AXES) > 4096:
                _AXES.clear()
            _AXES[key] = got
    return got
