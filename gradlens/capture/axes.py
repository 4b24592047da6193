"""The sample axis of a tensor of a tracked forward, followed from the model's input.

Each "data" tensor (computed from the batch) carries an :data:`Axis`: ``(axis, factor)`` says
that dim ``axis`` has size ``B * factor`` and that its index is ``n * factor + j`` for sample
``n`` (the samples are its leading factor: ``factor == 1`` is a plain sample axis; a window
partition ``[B, H, W, C] -> [B * nW, w * w, C]`` gives ``(0, nW)``); ``None`` says "unknown".
Rules per operation (:func:`carry`): reshapes (``view``, ``reshape``, ``flatten``,
``unflatten``, ``squeeze``, ``unsqueeze``) by matching groups of dims, ``transpose`` /
``permute`` / ``movedim`` by moving the axis, indexing, ``cat`` / ``stack`` / ``chunk`` /
``split`` / ``unbind``, reductions with ``dim``; any other operation keeps the axis where its
output has it unambiguously (same position from the left or from the right, same size), else
the axis is unknown. Nothing here guesses from sizes alone.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

__all__ = ["Axis", "carry", "reshaped", "moved"]

#: the type of a sample axis: ``(dim, factor)``, or None (unknown)
Axis = Any

_RESHAPES = {"view", "reshape", "flatten", "unflatten", "view_as", "reshape_as", "squeeze", "unsqueeze",
             "_unsafe_view", "squeeze_", "unsqueeze_", "ravel"}
_SWAPS = {"transpose", "swapaxes", "swapdims", "transpose_", "t", "t_"}
_PERMUTES = {"permute"}
_MOVES = {"movedim", "moveaxis"}
_SPLITS = {"chunk", "split", "tensor_split", "split_with_sizes", "unsafe_split"}
_CATS = {"cat", "concat", "concatenate"}
_REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "prod", "std", "var", "norm", "logsumexp",
               "nansum", "nanmean", "argmax", "argmin", "all", "any", "median", "count_nonzero"}


def _dim(d: int, nd: int) -> int:
    return d + nd if d < 0 else d


def reshaped(old: tuple[int, ...], new: tuple[int, ...], ax: Any, batch: int) -> Any:
    """The axis in ``new`` of a row-major reshape of a tensor of shape ``old`` with axis ``ax``
    (``(dim, factor)``), or None where the samples are not the leading factor of one new dim.

    Dims are matched in groups of equal products (``old[i0:i1]`` <-> ``new[j0:j1]``); in the
    sample axis' group the samples lead if every old dim before the axis has size 1; they stay
    the leading factor of the first new dim of the group whose size is not 1."""
    if ax is None or not old or math.prod(old) != math.prod(new) or 0 in old:
        return None
    a, f = ax
    if old[:a + 1] == new[:a + 1] and old[a] == batch * f:
        return ax  # the dims up to the axis unchanged: each is a group of its own (see below)
    if batch * f == 1 and old[a] == 1:  # one sample on a dim of size 1: it stays a dim of size 1
        ones = [k for k, n in enumerate(new) if n == 1]  # (the same rank among them), not the
        if ones:  # leading factor of a dim of features it would merge into ([1, 1, d] -> [1, d])
            return (ones[min(sum(1 for k in range(a) if old[k] == 1), len(ones) - 1)], 1)
    i = j = 0
    try:
        while i < len(old):
            i0, j0 = i, j
            po = old[i]
            pn = new[j] if j < len(new) else 1
            i, j = i + 1, j + 1
            while po != pn:
                if po < pn:
                    po *= old[i]
                    i += 1
                else:
                    pn *= new[j]
                    j += 1
            if not i0 <= a < i:
                continue
            if any(old[k] != 1 for k in range(i0, a)):
                return None  # the samples are not the leading factor of the group
            group = f * math.prod(old[a + 1:i])  # the group's flat index is n * group + r
            for k in range(j0, min(j, len(new))):
                rest = math.prod(new[k + 1:j])
                if new[k] % batch == 0 and (new[k] // batch) * rest == group:
                    return (k, new[k] // batch)
                if new[k] != 1:
                    return None
            return None
    except IndexError:
        return None
    return None


def moved(ax: Any, perm: list[int]) -> Any:
    """The axis after ``x.permute(perm)``."""
    if ax is None:
        return None
    return (perm.index(ax[0]), ax[1])


def _same(x: Tensor, ax: Any, o: Tensor) -> Any:
    """Any other operation: the axis kept where the output has it at the same position counted
    from the left or from the right with the same size, and only one such position."""
    if ax is None:
        return None
    a, f = ax
    xs, os_ = x.shape, o.shape
    size = xs[a]
    no = len(os_)
    left = a < no and os_[a] == size  # the same position from the left
    r = a - len(xs) + no
    right = 0 <= r < no and os_[r] == size  # from the right
    if left:
        return (a, f) if not right or r == a else None  # two positions: ambiguous
    return (r, f) if right else None


def _index(x: Tensor, ax: Any, idx: Any, o: Tensor) -> Any:
    """``x[idx]``: basic indexing (ints, slices, None, Ellipsis) moves the axis; a slice or int
    on the sample axis itself, or advanced indexing, makes it unknown (unless the output keeps
    it unambiguously)."""
    a, f = ax
    idx = idx if isinstance(idx, tuple) else (idx,)
    n_real = 0
    for i in idx:
        if isinstance(i, (Tensor, list)):  # advanced indexing
            return _same(x, ax, o)
        if i is not None and i is not Ellipsis:
            n_real += 1
    pos_in = pos_out = 0
    for i in idx:
        if i is Ellipsis:
            skip = x.dim() - n_real
            if pos_in <= a < pos_in + skip:
                return (pos_out + a - pos_in, f)
            pos_in += skip
            pos_out += skip
        elif i is None:
            pos_out += 1
        elif isinstance(i, slice):
            if pos_in == a:
                return (pos_out, f) if i == slice(None) else None
            pos_in += 1
            pos_out += 1
        else:  # an int
            if pos_in == a:
                return None
            pos_in += 1
    return (pos_out + a - pos_in, f)  # an untouched trailing dim


#: the descriptors of ``x.T``, ``x.H`` (all dims reversed) and ``x.mT``, ``x.mH`` (the last two
#: swapped): the mode sees their ``__get__``, a new method-wrapper on each access
_REVERSED = (torch.Tensor.T, torch.Tensor.H)
_LAST_TWO = (torch.Tensor.mT, torch.Tensor.mH)


def einsum_letter(args, t: Tensor, dim: int) -> tuple[str, str] | None:
    """``torch.einsum(eq, *operands)``: the subscript letter of dim ``dim`` of operand ``t`` and
    the explicit output subscripts (None without ``->``, with ``...``, or if ``t`` is not found)."""
    eq = args[0]
    ops_ = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
    if not isinstance(eq, str) or "->" not in eq or "." in eq:
        return None
    lhs, out = eq.replace(" ", "").split("->")
    subs = lhs.split(",")
    i = next((k for k, o in enumerate(ops_) if o is t), None)
    if i is None or i >= len(subs) or len(subs[i]) != t.dim():
        return None
    return subs[i][dim], out


def _einsum(args, x: Tensor, ax: Any) -> Any:
    """``torch.einsum``: the sample axis in the output, found in the explicit output subscripts
    (None if :func:`einsum_letter` cannot tell, or if it is summed out)."""
    found = einsum_letter(args, x, ax[0])
    if found is None or found[0] not in found[1]:
        return None
    return found[1].index(found[0]), ax[1]


def _int_arg(args, kwargs, i, name, default=None):
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


# ---------------------------------------------------------------------------- the rules
# Each rule gets (name, func, args, kwargs, x, ax, outs, batch, nd) and returns the axes of the
# outputs, or None where it does not apply (then :func:`_same` decides, as for any other
# operation).


def _reshape_rule(name, func, args, kwargs, x, ax, outs, batch, nd):
    if len(outs) != 1:
        return None
    old, new = x.shape, outs[0].shape
    a = ax[0]
    if (a < len(old) and old[:a + 1] == new[:a + 1] and old[a] == batch * ax[1] and 0 not in old
            and math.prod(old) == math.prod(new)):
        return [ax]  # what reshaped() gives first, without the call
    return [reshaped(old, new, ax, batch)]


def _squeeze_rule(name, func, args, kwargs, x, ax, outs, batch, nd):
    """``unsqueeze(d)`` / ``squeeze(d)``: the axis moves by the dim given (not by matching sizes,
    which a micro-batch of 1 would make ambiguous); ``squeeze()`` of every size-1 dim: a reshape."""
    if len(outs) != 1:
        return None
    a = ax[0]
    if name.startswith("unsqueeze"):
        d = _int_arg(args, kwargs, 1, "dim")
        if not isinstance(d, int):
            return None
        d = d + nd + 1 if d < 0 else d
        return [(a + 1 if d <= a else a, ax[1])]
    dims = _int_arg(args, kwargs, 1, "dim", None)
    if dims is None:
        return _reshape_rule(name, func, args, kwargs, x, ax, outs, batch, nd)
    dims = [dims] if isinstance(dims, int) else list(dims)
    dims = [_dim(d, nd) for d in dims]
    dims = [d for d in dims if x.shape[d] == 1]
    if a in dims:
        return [None]  # the sample dim squeezed away (a micro-batch of one)
    return [(a - sum(1 for d in dims if d < a), ax[1])]


def _swap_rule(name, func, args, kwargs, x, ax, outs, batch, nd):
    if len(outs) != 1:
        return None
    if name in ("t", "t_"):
        d0, d1 = 0, 1
    else:
        d0 = args[1] if len(args) > 1 else kwargs.get("dim0")
        d1 = args[2] if len(args) > 2 else kwargs.get("dim1")
        d0 = d0 + nd if d0 < 0 else d0
        d1 = d1 + nd if d1 < 0 else d1
    if not (0 <= d0 < nd and 0 <= d1 < nd):
        raise IndexError(f"transpose of dims {d0}, {d1} of a {nd}-d tensor")
    a = ax[0]  # what moved() gives for the permutation that swaps d0 and d1
    return [(d1 if a == d0 else d0 if a == d1 else a, ax[1])]


def _get_rule(name, func, args, kwargs, x, ax, outs, batch, nd):
    owner = getattr(func, "__self__", None)
    if any(owner is d for d in _REVERSED):  # x.T / x.H
        return [moved(ax, list(range(nd))[::-1])]
    if any(owner is d for d in _LAST_TWO) and nd >= 2:  # x.mT / x.mH
        perm = list(range(nd))
        perm[-1], perm[-2] = perm[-2], perm[-1]
        return [moved(ax, perm)]
    return None


def _rot90_rule(name, func, args, kwargs, x, ax, outs, batch, nd):
    if len(outs) != 1:
        return None
    k = _int_arg(args, kwargs, 1, "k", 1)  # k odd: the two dims swap
    dims = [_dim(d, nd) for d in _int_arg(args, kwargs, 2, "dims", [0, 1])]
    perm = list(range(nd))
    if k % 2:
        perm[dims[0]], perm[dims[1]] = perm[dims[1]], perm[dims[0]]
    return [moved(ax, perm)]


def _einsum_rule(name, func, args, kwargs, x, ax, outs, batch, nd):
    return [_einsum(args, x, ax)] if len(outs) == 1 else None


def _permute_rule(name, func, args, kwargs, x, ax, outs, batch, nd):
    if len(outs) != 1:
        return None
    dims = args[1:] if len(args) > 2 else _int_arg(args, kwargs, 1, "dims")
    if len(dims) == 1 and isinstance(dims[0], (list, tuple, torch.Size)):
        dims = dims[0]
    return [moved(ax, [_dim(int(d), nd) for d in dims])]


def _move_rule(name, func, args, kwargs, x, ax, outs, batch, nd):
    if len(outs) != 1:
        return None
    src, dst = _int_arg(args, kwargs, 1, "source"), _int_arg(args, kwargs, 2, "destination")
    src = [src] if isinstance(src, int) else list(src)
    dst = [dst] if isinstance(dst, int) else list(dst)
    src, dst = [_dim(s, nd) for s in src], [_dim(d, nd) for d in dst]
    perm = [None] * nd
    for s_, d in zip(src, dst):
        perm[d] = s_
    rest = iter(i for i in range(nd) if i not in src)
    perm = [p if p is not None else next(rest) for p in perm]
    return [moved(ax, perm)]


def _getitem_rule(name, func, args, kwargs, x, ax, outs, batch, nd):
    return [_index(x, ax, args[1], outs[0])] if len(outs) == 1 else None


def _select_rule(name, func, args, kwargs, x, ax, outs, batch, nd):
    if len(outs) != 1:
        return None
    d = _dim(_int_arg(args, kwargs, 1, "dim"), nd)
    if d == ax[0]:
        return [None]
    return [(ax[0] - 1 if name == "select" and d < ax[0] else ax[0], ax[1])]


def _split_rule(name, func, args, kwargs, x, ax, outs, batch, nd):
    d = _dim(_int_arg(args, kwargs, 2 if name != "unbind" else 1, "dim", 0), nd)
    if d == ax[0]:
        return [None] * len(outs)
    if name == "unbind":
        return [(ax[0] - 1 if d < ax[0] else ax[0], ax[1])] * len(outs)
    return [ax] * len(outs)


def _cat_rule(name, func, args, kwargs, x, ax, outs, batch, nd):
    if len(outs) != 1:
        return None
    d = _dim(_int_arg(args, kwargs, 1, "dim", 0), nd)
    return [None if d == ax[0] else ax]


def _stack_rule(name, func, args, kwargs, x, ax, outs, batch, nd):
    if len(outs) != 1:
        return None
    d = _dim(_int_arg(args, kwargs, 1, "dim", 0), nd + 1)
    return [(ax[0] + 1, ax[1]) if d <= ax[0] else ax]


def _reduction_rule(name, func, args, kwargs, x, ax, outs, batch, nd):
    if not ("dim" in kwargs or len(args) > 1) or len(outs) < 1:
        return None
    dims = _int_arg(args, kwargs, 1, "dim")
    if isinstance(dims, int):
        dims = [dims]
    if not (isinstance(dims, (list, tuple)) and all(isinstance(d, int) for d in dims)):
        return None
    dims = [_dim(d, nd) for d in dims]
    if ax[0] in dims:
        return [None] * len(outs)
    keep = bool(_int_arg(args, kwargs, 2, "keepdim", False))
    a = ax[0] if keep else ax[0] - sum(1 for d in dims if d < ax[0])
    return [(a, ax[1]) if o.dim() > a else None for o in outs]


def _complex_rule(name, func, args, kwargs, x, ax, outs, batch, nd):
    """``view_as_real`` (a last dim of 2 added) / ``view_as_complex`` (the last dim of 2
    taken): the leading dims stay where they are (a rotary embedding in complex numbers)."""
    if name == "view_as_complex" and ax[0] >= nd - 1:
        return None
    return [ax if o.dim() > ax[0] else None for o in outs]


#: operation name -> its rule
_RULES: dict[str, Any] = {
    "view_as_real": _complex_rule,
    "view_as_complex": _complex_rule,
    **{n: _reshape_rule for n in _RESHAPES},
    **{n: _squeeze_rule for n in ("squeeze", "squeeze_", "unsqueeze", "unsqueeze_")},
    **{n: _swap_rule for n in _SWAPS},
    "__get__": _get_rule,
    "rot90": _rot90_rule,
    "einsum": _einsum_rule,
    **{n: _permute_rule for n in _PERMUTES},
    **{n: _move_rule for n in _MOVES},
    "__getitem__": _getitem_rule,
    "select": _select_rule,
    "narrow": _select_rule,
    **{n: _split_rule for n in _SPLITS | {"unbind"}},
    **{n: _cat_rule for n in _CATS},
    "stack": _stack_rule,
    **{n: _reduction_rule for n in _REDUCTIONS},
}


def carry(func, args: tuple, kwargs: dict, x: Tensor, ax: Any, outs: list[Tensor], batch: int) -> list[Any]:
    """The axis of each output of ``func(*args, **kwargs)``, ``x`` being its first data
    argument with axis ``ax``."""
    if ax is None or batch is None:
        return [None] * len(outs)
    rule = _RULES.get(getattr(func, "__name__", ""))
    if rule is None:  # the common case (elementwise, matmul, ...): what _same gives
        shape = x.shape
        if ax[0] < len(shape):
            return [ax if o.shape == shape else _same(x, ax, o) for o in outs]
    else:
        try:
            got = rule(func.__name__, func, args, kwargs, x, ax, outs, batch, x.dim())
            if got is not None:
                return got
        except (TypeError, ValueError, IndexError, AttributeError):
            pass
    return [_same(x, ax, o) for o in outs]


#: the names with a rule of their own in :func:`carry`; any other operation keeps the axis where
#: :func:`_same` finds it (an output of the data argument's shape: where it is)
RULED = frozenset(_RULES)
