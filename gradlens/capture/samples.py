"""What an operation of a tracked forward does to the samples, beyond moving their axis
(:mod:`gradlens.capture.axes` moves it): it reorders, selects or repeats the rows of the batch
(the axis becomes a :class:`~gradlens.capture.rows.Rows`), it mixes them (:class:`Mix`: a row of
its output depends on several samples) or it reduces over them (:class:`Pool`).

:func:`follow` is called by the capture, for the functions of :data:`TABLE` only, with the answer
:func:`gradlens.capture.axes.carry` gave; it returns the answer to keep. Operations with several
data arguments are checked by :func:`aligned` (elementwise operations, ``matmul`` and its kin,
``einsum``): each argument that requires grad must hold its samples where the others do.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from gradlens.capture.axes import _dim, _index, _int_arg, einsum_letter
from gradlens.capture.rows import Mix, Pool, Rows, owner_of, packed_owner, rows_axis, unify
from gradlens.capture.writes import _index_write, _mark, _setitem

__all__ = ["follow", "aligned", "pairwise", "TABLE", "ROWS", "CONTRACTIONS", "LINEAR", "REDUCTIONS"]


def _owner(x: Tensor, ax: Any, batch: int) -> Tensor | None:
    return owner_of(ax, x.shape[ax[0]], batch, x.device)


def _where(name: str, x: Tensor, a: int) -> str:
    return f"{name} along the samples (dim {a} of a {list(x.shape)} tensor)"


# --------------------------------------------------------------------------- along a dim
#: operations along one dim: (position of the dim argument, its default); the dim of F.softmax
#: and its kin may be None (the legacy implicit dim)
_ALONG = {
    "softmax": (1, None), "log_softmax": (1, None), "softmin": (1, None), "gumbel_softmax": (4, -1),
    "cumsum": (1, None), "cumprod": (1, None), "cummax": (1, None), "cummin": (1, None),
    "logcumsumexp": (1, None), "cumsum_": (1, None), "cumprod_": (1, None),
    "sort": (1, -1), "argsort": (1, -1), "msort": (None, 0), "topk": (2, -1), "kthvalue": (2, -1),
    "diff": (2, -1), "normalize": (2, 1), "glu": (1, -1),
    "flip": (1, None), "flipud": (None, 0), "fliplr": (None, 1), "roll": (2, None),
}
_PERMUTE = {"flip", "flipud", "fliplr", "roll"}
_SORTS = {"sort", "msort", "topk", "kthvalue"}


def _implicit_softmax_dim(nd: int) -> int:
    return 0 if nd in (0, 1, 3) else 1


def _dims_arg(args, kwargs, pos, name):
    """A dims argument given as ints (``x.flip(0, 1)``), a list or tuple, or by keyword."""
    if len(args) > pos + 1 and all(isinstance(d, int) for d in args[pos:]):
        return list(args[pos:])
    dims = _int_arg(args, kwargs, pos, name, None)
    if dims is None:
        return None
    return [dims] if isinstance(dims, int) else list(dims)


def _along(name, func, args, kwargs, x, ax, outs, batch, got, marks):
    pos, default = _ALONG[name]
    nd = x.dim()
    a = ax[0]
    if name == "flip":
        dims = _dims_arg(args, kwargs, 1, "dims") or []
        if a not in [_dim(int(d), nd) for d in dims]:
            return None
        return [_rows_of(x, ax, batch, lambda o: o.flip(0), a)]
    if name == "roll":
        shifts = _int_arg(args, kwargs, 1, "shifts")
        shifts = [shifts] if isinstance(shifts, int) else list(shifts)
        dims = _dims_arg(args, kwargs, 2, "dims")
        if dims is None:  # rolled as one flat tensor
            if nd == 1:
                return [_rows_of(x, ax, batch, lambda o: o.roll(int(shifts[0])), a)]
            return [Mix(None, _where("torch.roll", x, a) + " (rolled flat)")]
        for s, d in zip(shifts, dims):
            if _dim(int(d), nd) == a:
                return [_rows_of(x, ax, batch, lambda o, s=int(s): o.roll(s), a)]
        return None
    d = default if pos is None else _int_arg(args, kwargs, pos, "dim", default)
    if d is None:
        if name not in ("softmax", "log_softmax", "softmin"):
            return None
        d = _implicit_softmax_dim(nd)
    if not isinstance(d, int) or _dim(d, nd) != a:
        return None
    if name in _PERMUTE:  # flipud / fliplr
        return [_rows_of(x, ax, batch, lambda o: o.flip(0), a)]
    what = _where(f"torch.{name}", x, a)
    kept = got[0] if got else None
    if name in _SORTS and len(outs) > 1 and x.numel() == x.shape[a]:
        own = _owner(x, ax, batch)  # a 1-D batch sorted: a permutation of its rows, read from indices
        if own is not None:
            return [rows_axis(a, own[outs[1].reshape(-1).to(own.device)], batch), None]
    if name == "argsort":
        return [None]  # indices of samples, not samples
    return [Mix(kept, what)] + [None] * (len(outs) - 1)


def _rows_of(x: Tensor, ax: Any, batch: int, how, dim: int) -> Any:
    own = _owner(x, ax, batch)
    if own is None:
        return None
    return rows_axis(dim, how(own), batch)


# --------------------------------------------------------------------------- reductions
_LINEAR_REDUCTIONS = {"sum", "mean", "nansum", "nanmean"}
_REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "prod", "std", "var", "norm", "logsumexp",
               "nansum", "nanmean", "median", "nanmedian", "var_mean", "std_mean", "vector_norm", "aminmax",
               "mode", "quantile", "nanquantile"}


#: reductions along dims (what ends a pairwise product of the samples, as contractions do)
REDUCTIONS = frozenset(_REDUCTIONS)


def _reduction(name, func, args, kwargs, x, ax, outs, batch, got, marks):
    if got and any(g is not None for g in got):
        return None  # the samples kept: reduced over other dims
    pos = 2 if name in ("norm", "vector_norm", "quantile", "nanquantile") else 1
    if len(args) > pos and isinstance(args[pos], Tensor):
        return None  # torch.max(a, b): elementwise (other rules decide)
    dims = _int_arg(args, kwargs, pos, "dim", None)
    nd = x.dim()
    if dims is not None:
        if isinstance(dims, int):
            dims = [dims]
        if not (isinstance(dims, (list, tuple)) and all(isinstance(d, int) for d in dims)):
            return None
        if dims and ax[0] not in [_dim(d, nd) for d in dims]:
            return None
    if batch == 1 and dims and outs and isinstance(outs[0], Tensor) and outs[0].dim() > 1:
        # one sample: its rows reduced stay its own (every row of what is left holds it; a
        # vector left is a pooled value as for any batch: its one dim may be the features')
        return [(0, outs[0].shape[0]) if isinstance(o, Tensor) and o.dim() > 0 else None for o in outs]
    how = "over the samples" if dims else "over every dim, the samples included"
    what = f"torch.{name} {how} (dim {ax[0]} of a {list(x.shape)} tensor)"
    return [Pool(what, name in _LINEAR_REDUCTIONS)] * len(outs)


# --------------------------------------------------------------------------- rows of the batch
def _getitem(name, func, args, kwargs, x, ax, outs, batch, got, marks):
    idx = args[1] if len(args) > 1 else None
    comps = idx if isinstance(idx, tuple) else (idx,)
    if args and x is not args[0]:
        return _lookup(comps, x, ax, outs)
    has_adv = any(isinstance(c, (Tensor, list)) for c in comps)
    if got and got[0] is not None and not has_adv:
        return None  # basic indexing that kept the samples whole: carry's answer
    nd = x.dim()
    a = ax[0]
    # which component indexes the sample dim, the dims each one consumes
    n_real = sum((c.dim() if isinstance(c, Tensor) and c.dtype == torch.bool else 1)
                 for c in comps if c is not None and c is not Ellipsis)
    pos = 0
    hit = None
    adv = [c for c in comps if isinstance(c, (Tensor, list)) or (isinstance(c, int) and not isinstance(c, bool))]
    for c in comps:
        if c is Ellipsis:
            pos += nd - n_real
            continue
        if c is None:
            continue
        width = c.dim() if isinstance(c, Tensor) and c.dtype == torch.bool else 1
        if pos <= a < pos + width:
            hit = (c, pos, width)
            break
        pos += width
    if hit is None:
        return None  # the sample dim untouched (a trailing dim): carry's answer
    c, start, width = hit
    if isinstance(c, slice) and c == slice(None):
        return None
    if isinstance(c, int) and not isinstance(c, bool):
        return None  # one sample picked: no sample axis
    if has_adv and len(adv) > 1:
        return _getitem_joint(comps, adv, c, x, ax, outs, batch)
    if has_adv and not isinstance(c, (Tensor, list)):
        return None  # the samples sliced beside an advanced index elsewhere: not followed
    # the output dim of the sample component: as if it were a full slice
    probe = tuple(slice(None) if comp is c else comp for comp in comps)
    if isinstance(c, Tensor) and c.dtype == torch.bool and c.dim() > 1:
        probe = tuple(x for comp in comps for x in ((slice(None),) * c.dim() if comp is c else (comp,)))
    try:
        kept = _index(x, (start, 1), probe, outs[0])
    except (TypeError, ValueError, IndexError):
        return None
    if kept is None:
        return None
    out_dim = kept[0]
    own = owner_of(ax, x.shape[a], batch, x.device)
    if own is None:
        return None
    if isinstance(c, slice):
        new = own[c]
    elif isinstance(c, Tensor) and c.dtype == torch.bool:
        shape = [1] * c.dim()
        shape[a - start] = own.numel()
        new = own.view(shape).expand(c.shape)[c.to(own.device)]
    else:
        t = torch.as_tensor(c, device=own.device)
        if t.dim() != 1 or t.is_floating_point():
            return None
        new = own[t]
    if outs[0].dim() <= out_dim or outs[0].shape[out_dim] != new.numel():
        return None
    return [rows_axis(out_dim, new, batch)]


def _lookup(comps: tuple, ids: Tensor, ax: Any, outs: list) -> Any:
    """``w[ids]``: a tensor indexed by data ``ids`` (a routed expert's weights per token,
    ``gate_up_proj[expert_ids]``): its rows are those of ``ids``, on the same dims, where ``ids``
    is the first index and the others take whole dims."""
    if not comps or comps[0] is not ids or ids.dtype == torch.bool or ids.is_floating_point():
        return None
    if any(not (isinstance(c, slice) and c == slice(None)) and c is not Ellipsis for c in comps[1:]):
        return None
    out = outs[0]
    if out.dim() < ids.dim() or tuple(out.shape[:ids.dim()]) != tuple(ids.shape):
        return None
    return [ax]


def _getitem_joint(comps: tuple, adv: list, c: Any, x: Tensor, ax: Any, outs: list, batch: int) -> Any:
    """``x[i, j]`` with several advanced indices, the sample dim's ``c`` among them (a routed
    token's gate weight ``w[token_idx, top_k_pos]``): with 1-D (or scalar) indices broadcast to
    one length n, output row k is taken from row ``c[k]`` of the samples' dim, so it holds
    sample ``owner[c[k]]``. The rows land where numpy puts the advanced block: at the first
    advanced index's place when they are adjacent, else first."""
    if not isinstance(c, (Tensor, list)):
        return None
    c = torch.as_tensor(c)
    if c.dim() != 1 or c.dtype == torch.bool or c.is_floating_point():
        return None
    n = c.numel()
    for other in adv:
        if isinstance(other, bool):
            return None
        if isinstance(other, (Tensor, list)):
            t = torch.as_tensor(other)
            if t.dtype == torch.bool or t.is_floating_point() or t.dim() > 1 or (t.dim() == 1 and t.numel() not in (1, n)):
                return None
    where = [k for k, comp in enumerate(comps) if any(comp is a for a in adv)]
    if where != list(range(where[0], where[-1] + 1)):
        out_dim = 0
    else:
        nd = x.dim()
        n_real = sum(1 for comp in comps if comp is not None and comp is not Ellipsis)
        out_dim = 0
        for comp in comps[:where[0]]:
            out_dim += (nd - n_real) if comp is Ellipsis else 1
    own = owner_of(ax, x.shape[ax[0]], batch, x.device)
    if own is None or outs[0].dim() <= out_dim or outs[0].shape[out_dim] != n:
        return None
    return [rows_axis(out_dim, own[c.to(own.device)], batch)]


def _index_select(name, func, args, kwargs, x, ax, outs, batch, got, marks):
    d = _dim(_int_arg(args, kwargs, 1, "dim"), x.dim())
    if d != ax[0]:
        return None
    index = _int_arg(args, kwargs, 2, "index")
    own = _owner(x, ax, batch)
    if own is None or not isinstance(index, Tensor):
        return None
    return [rows_axis(d, own[index.reshape(-1).to(own.device)], batch)]


def _narrow(name, func, args, kwargs, x, ax, outs, batch, got, marks):
    d = _dim(_int_arg(args, kwargs, 1, "dim"), x.dim())
    if d != ax[0]:
        return None
    start, length = int(_int_arg(args, kwargs, 2, "start")), int(_int_arg(args, kwargs, 3, "length"))
    own = _owner(x, ax, batch)
    if own is None:
        return None
    start = start + own.numel() if start < 0 else start
    return [rows_axis(d, own[start:start + length], batch)]


def _split(name, func, args, kwargs, x, ax, outs, batch, got, marks):
    if name == "unbind":
        return None
    d = _dim(_int_arg(args, kwargs, 2, "dim", 0), x.dim())
    if d != ax[0]:
        return None
    own = _owner(x, ax, batch)
    if own is None:
        return None
    parts, start = [], 0
    for o in outs:
        n = o.shape[d]
        parts.append(rows_axis(d, own[start:start + n], batch))
        start += n
    return parts


def _cat(name, func, args, kwargs, x, ax, outs, batch, got, marks):
    parts = _int_arg(args, kwargs, 0, "tensors")
    if not isinstance(parts, (list, tuple)):
        return None
    nd = x.dim()
    d = _dim(_int_arg(args, kwargs, 1, "dim", 0), nd)
    axes = []
    for t in parts:
        if t is x:
            axes.append(ax)
            continue
        is_data, tax = _mark(marks, t)
        if not is_data:
            if isinstance(t, Tensor) and t.numel() == 0:
                axes.append("empty")
            elif d == ax[0]:
                if not isinstance(t, Tensor) or t.requires_grad:
                    return [None]  # rows of a parameter among the samples: not followed
                axes.append("const")  # a constant's rows: of no sample until one claims them
            else:
                axes.append("const")  # the same for every sample (broadcast): no samples of its own
            continue
        axes.append(tax)
    if d != ax[0]:  # joined along another dim: every data part holds the same samples in its rows
        data = [t for t in axes if not isinstance(t, str)]
        if all(t is not None and unify(t, ax) for t in data):
            return None  # carry's answer
        grads = any(isinstance(t, Tensor) and t.requires_grad for t in parts)
        return [Mix(got[0] if got else None, f"torch.cat of tensors whose samples are in different rows "
                                            f"(dim {d})")] if grads else [None]
    owners = []
    for t, tax in zip(parts, axes):
        if tax == "empty":
            continue
        if tax == "const":
            owners.append(torch.full((t.shape[d],), -1, dtype=torch.int64, device=x.device))
            continue
        if tax is None or tax[0] != d:
            return [None]
        own = owner_of(tax, t.shape[d], batch, x.device)
        if own is None:
            return [None]
        owners.append(own.to(x.device))
    return [rows_axis(d, torch.cat(owners), batch)]


def _stack(name, func, args, kwargs, x, ax, outs, batch, got, marks):
    parts = _int_arg(args, kwargs, 0, "tensors")
    if not isinstance(parts, (list, tuple)):
        return None
    for t in parts:
        if t is x:
            continue
        is_data, tax = _mark(marks, t)
        if is_data and not unify(tax, ax):
            if any(isinstance(p, Tensor) and p.requires_grad for p in parts):
                return [Mix(got[0] if got else None, "torch.stack of tensors whose samples are in different rows")]
            return [None]
    if type(ax) is Rows and got and got[0] is not None:
        return [ax.at(got[0][0])]
    return None


def _repeat_interleave(name, func, args, kwargs, x, ax, outs, batch, got, marks):
    repeats = _int_arg(args, kwargs, 1, "repeats")
    d = _int_arg(args, kwargs, 2, "dim", None)
    nd = x.dim()
    if d is None:
        if nd != 1:
            return None
        d = 0
    d = _dim(d, nd)
    if d != ax[0]:
        return None
    own = _owner(x, ax, batch)
    if own is None:
        return None
    if isinstance(repeats, Tensor):
        repeats = repeats.to(own.device)
    return [rows_axis(d, own.repeat_interleave(repeats), batch)]


def _repeat(name, func, args, kwargs, x, ax, outs, batch, got, marks):
    sizes = args[1:] if len(args) > 2 or (len(args) == 2 and isinstance(args[1], int)) else _int_arg(
        args, kwargs, 1, "repeats" if name == "repeat" else "dims")
    if isinstance(sizes, int):
        sizes = [sizes]
    sizes = list(sizes)
    nd = x.dim()
    if name == "tile" and len(sizes) < nd:
        sizes = [1] * (nd - len(sizes)) + sizes
    lead = len(sizes) - nd
    if lead < 0:
        return None
    k = int(sizes[lead + ax[0]])
    own = _owner(x, ax, batch)
    if own is None:
        return None
    return [rows_axis(lead + ax[0], own.repeat(k), batch)]


def _gather(name, func, args, kwargs, x, ax, outs, batch, got, marks):
    if name == "gather":
        d, index = _int_arg(args, kwargs, 1, "dim"), _int_arg(args, kwargs, 2, "index")
    else:  # take_along_dim(input, indices, dim)
        index, d = _int_arg(args, kwargs, 1, "indices"), _int_arg(args, kwargs, 2, "dim", None)
        if d is None:
            return None
    nd = x.dim()
    d = _dim(d, nd)
    if d != ax[0] or not isinstance(index, Tensor) or index.dim() != nd:
        return None
    first = index
    for k in range(nd):  # the rows taken: the index of the first column, where every column agrees
        if k != d and first.shape[k] > 1:
            first = first.narrow(k, 0, 1)
    if index.numel() and not bool((index == first).all()):
        what = _where(f"torch.{name}", x, d) + " with another row per column"
        return [Mix(got[0] if got else None, what)]
    own = _owner(x, ax, batch)
    if own is None:
        return None
    return [rows_axis(d, own[first.reshape(-1).to(own.device)], batch)]


def _pack(name, func, args, kwargs, x, ax, outs, batch, got, marks):
    batch_first = bool(_int_arg(args, kwargs, 2, "batch_first", False))
    d = 0 if batch_first else 1
    if ax[0] != d or len(outs) < 2:
        return None
    own = _owner(x, ax, batch)
    if own is None:
        return None
    rows = packed_owner(outs[1], None, own.device)  # the i-th sequence of the (sorted) input
    return [rows_axis(0, own[rows], batch), None]


def _pad(name, func, args, kwargs, x, ax, outs, batch, got, marks):
    if ax[0] != 0 or len(outs) < 1:
        return None
    batch_first = bool(_int_arg(args, kwargs, 2, "batch_first", False))
    sizes = _int_arg(args, kwargs, 1, "batch_sizes")
    own = _owner(x, ax, batch)
    if own is None or not isinstance(sizes, Tensor) or not sizes.numel():
        return None
    n = int(sizes[0])
    return [rows_axis(0 if batch_first else 1, own[:n], batch)] + [None] * (len(outs) - 1)


def _embedding_bag(name, func, args, kwargs, x, ax, outs, batch, got, marks):
    offsets = _int_arg(args, kwargs, 2, "offsets", None)
    if x.dim() != 1 or not isinstance(offsets, Tensor):
        return None
    last = bool(kwargs.get("include_last_offset", args[9] if len(args) > 9 else False))
    bags = offsets.numel() - (1 if last else 0)
    return [(0, 1) if bags == batch else None]


def _layer_norm(name, func, args, kwargs, x, ax, outs, batch, got, marks):
    shape = _int_arg(args, kwargs, 1, "normalized_shape")
    k = 1 if isinstance(shape, int) else len(shape)
    if ax[0] < x.dim() - k:
        return None
    return [Mix(got[0] if got else None, _where("F.layer_norm", x, ax[0]) + " (normalized over it)")]


def _groups(old: tuple, new: tuple, a: int) -> tuple[int, int, int, int] | None:
    """``(i0, i1, j0, j1)``: the dims ``old[i0:i1]`` (holding dim ``a``) and ``new[j0:j1]`` of a
    reshape that hold the same elements (equal products, the smallest such groups)."""
    i = j = 0
    while i < len(old):
        i0, j0 = i, j
        po, pn = old[i], new[j] if j < len(new) else 1
        i, j = i + 1, j + 1
        while po != pn:
            if po < pn:
                if i >= len(old):
                    return None
                po *= old[i]
                i += 1
            else:
                if j >= len(new):
                    return None
                pn *= new[j]
                j += 1
        while j < len(new) and new[j] == 1 and i < len(old) and old[i] != 1:
            j += 1  # (size-1 dims join the group before)
        if i0 <= a < i:
            return i0, i, j0, j
    return None


def _reshape(name, func, args, kwargs, x, ax, outs, batch, got, marks):
    """A reshape in which the samples are not the leading factor of a dim (``[T, B, d] ->
    [T * B, d]``) or rows of samples are split or merged: the sample of each row of the new dim
    that holds them, read from where each element came from."""
    if len(outs) != 1:
        return None
    rows_kept = bool(got and type(got[0]) is Rows)  # carry moved the rows: kept, unless they are the samples in order
    if got and got[0] is not None and not rows_kept:
        return None
    old, new = tuple(x.shape), tuple(outs[0].shape)
    if math.prod(old) != math.prod(new) or 0 in old:
        return None
    a = ax[0]
    g = _groups(old, new, a)
    if g is None:
        return None
    i0, i1, j0, j1 = g
    own = owner_of(ax, old[a], batch, x.device)
    if own is None:
        return None
    view = [1] * (i1 - i0)
    view[a - i0] = old[a]
    flat = own.view(view).expand(old[i0:i1]).reshape(new[j0:j1])  # the sample of each element
    found, plain = None, []
    for k in range(j1 - j0):
        line = flat
        for d in range(j1 - j0):  # the first element along every other dim
            if d != k:
                line = line.narrow(d, 0, 1)
        if not bool((flat == line).all()):
            continue
        line = line.reshape(-1)
        f = line.numel() // batch if batch else 0
        if f and line.numel() == batch * f and bool((line == torch.arange(batch, device=line.device)
                                                     .repeat_interleave(f)).all()):
            plain.append((j0 + k, f))  # the samples in order, as the leading factor
        elif found is None and not rows_kept and not (new[j0 + k] == 1 and j1 - j0 > 1):
            found = rows_axis(j0 + k, line, batch)
    if plain:  # several only when each sample's rows fill a block of every dim (one sample, B = 1):
        # a dim with one row per sample, else the innermost (the rows of one sample split last)
        return [next((p for p in plain if p[1] == 1), plain[-1])]
    return None if found is None else [found]  # None: the samples spread over several dims


#: methods whose second tensor gives only a shape or a dtype (no samples flow from it)
_SHAPE_ONLY = ("expand_as", "type_as")

#: function name -> its rule (called by the capture with carry's answer)
TABLE: dict[str, Any] = {
    **{n: _along for n in _ALONG},
    **{n: _reduction for n in _REDUCTIONS},
    "__getitem__": _getitem,
    "index_select": _index_select,
    "narrow": _narrow,
    **{n: _split for n in ("chunk", "split", "tensor_split", "split_with_sizes", "unsafe_split", "unbind")},
    **{n: _cat for n in ("cat", "concat", "concatenate")},
    "stack": _stack,
    "repeat_interleave": _repeat_interleave,
    "repeat": _repeat,
    "tile": _repeat,
    "gather": _gather,
    "take_along_dim": _gather,
    "_pack_padded_sequence": _pack,
    "_pad_packed_sequence": _pad,
    "embedding_bag": _embedding_bag,
    "layer_norm": _layer_norm,
    **{n: _reshape for n in ("view", "reshape", "flatten", "unflatten", "view_as", "reshape_as", "_unsafe_view",
                             "ravel")},
    **{n: _index_write for n in ("index_put", "index_put_", "index_copy", "index_copy_", "index_add",
                                 "index_add_", "scatter", "scatter_", "scatter_add", "scatter_add_")},
    "__setitem__": _setitem,
    **{n: (lambda *a: None) for n in _SHAPE_ONLY},
}


#: the functions of :data:`TABLE` whose rule reads their other tensor arguments itself (indices,
#: the parts of a ``cat``): several data arguments are theirs to check
ROWS = frozenset(n for n, r in TABLE.items() if r not in (_along, _reduction, _layer_norm))
SHAPE_ONLY = frozenset(_SHAPE_ONLY)


def follow(func, args: tuple, kwargs: dict, x: Tensor, ax: Any, outs: list, batch: int, got: list,
           marks: Any = None) -> list:
    """The answer to keep for an operation of :data:`TABLE`: ``got`` (carry's axes of its
    outputs) or what the rows, mixing or pooling of the samples make of it. ``marks``: the
    capture's marks of data tensors (the other parts of a ``cat``)."""
    if ax is None or batch is None:
        return got
    name = getattr(func, "__name__", "")
    rule = TABLE.get(name)
    if rule is None:
        return got
    try:
        new = rule(name, func, args, kwargs, x, ax, outs, batch, got, marks)
    except (TypeError, ValueError, IndexError, AttributeError, RuntimeError):
        return got
    if new is None:
        return got
    if len(new) < len(outs):
        new = list(new) + [None] * (len(outs) - len(new))
    return new[:len(outs)]


# --------------------------------------------------------------------------- several data arguments
#: products whose arguments' dims do not line up elementwise
CONTRACTIONS = frozenset({"matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "baddbmm", "addbmm",
                          "einsum", "cdist", "mv", "addmv", "inner", "outer", "ger", "tensordot", "kron",
                          "chain_matmul", "dot", "vdot", "bilinear", "cosine_similarity", "pairwise_distance"})

#: operations that leave a pooled value a linear function of the samples' sums (the others,
#: applied to one, make a loss that is no sum over samples)
LINEAR = frozenset({
    "add", "__add__", "__radd__", "__iadd__", "add_", "sub", "__sub__", "__rsub__", "__isub__", "sub_", "rsub",
    "subtract", "neg", "__neg__", "negative", "__pos__", "positive", "mul", "__mul__", "__rmul__", "__imul__",
    "mul_", "multiply", "div", "__truediv__", "__itruediv__", "div_", "true_divide", "divide", "sum", "mean",
    "nansum", "nanmean", "view", "reshape", "view_as", "reshape_as", "flatten", "unflatten", "squeeze",
    "unsqueeze", "__getitem__", "expand", "expand_as", "broadcast_to", "transpose", "permute", "t", "contiguous",
    "clone", "to", "float", "double", "half", "bfloat16", "type", "type_as", "detach", "cat", "stack",
    "select", "narrow", "movedim", "__get__", "alias", "requires_grad_", "_to_copy", "sum_to_size",
})

#: among those, the ones linear in each argument only while at most one requires grad
#: (a product of two pooled values, or a quotient by one, is no sum over samples)
_BILINEAR = frozenset({"mul", "__mul__", "__rmul__", "__imul__", "mul_", "multiply", "div", "__truediv__",
                       "__itruediv__", "div_", "true_divide", "divide"})


def linear_in_pooled(func, grads: list[tuple[Any, Tensor]]) -> bool:
    """Whether ``func`` keeps a pooled value (a sum or mean over samples) linear, given its
    arguments that require grad ``(position, tensor)``."""
    name = getattr(func, "__name__", "")
    if name not in LINEAR:
        return False
    if name in _BILINEAR:
        return len(grads) <= 1 and (name in ("mul", "__mul__", "__rmul__", "__imul__", "mul_", "multiply")
                                    or not grads or grads[0][0] == 0)
    return True


def batch_statistic(func, entries: list, pooled: Any) -> Tensor | None:
    """The tensor that weights a pooled value (a sum over samples) with a statistic of the whole
    batch in a product or quotient: a data tensor of more than one element without gradient and
    without a sample axis (``entries``: the call's data arguments ``(position, tensor, axis)``),
    e.g. a MoE load-balancing loss's fraction of tokens per expert. Each sample's share then
    depends on the other samples, so the pooled value is no sum of per-sample terms of their
    own. A scalar (a token count dividing a loss) only sets the units (docs/design.md); None."""
    if getattr(func, "__name__", "") not in _BILINEAR:
        return None
    for _, t, ax in entries:
        if ax is None and not t.requires_grad and t.numel() > 1 and t not in pooled:
            return t
    return None


def _matmul_place(pos: int, t: Tensor, a: int, out: Tensor, name: str, n_args: int) -> tuple[str, int] | None:
    """Where the sample dim ``a`` of argument ``pos`` of a matmul-like call lands: ``("out",
    dim)``, ``("sum", "k")`` (the contracted dim), ``("lost", -1)`` (broadcast away), or None
    (not followed)."""
    nd, no = t.dim(), out.dim()
    if name in ("addmm", "baddbmm", "addmv", "addbmm"):
        if pos == 0:  # the added input: broadcast like an elementwise argument
            r = a + no - nd
            return ("out", r) if 0 <= r < no and out.shape[r] == t.shape[a] else ("lost", -1)
        pos -= 1
    if name == "__rmatmul__":
        pos = 1 - pos
    if nd == 1:
        return ("sum", "k")  # a vector: its only dim is contracted
    if pos == 0:  # [..., n, k]: rows land on -2, k is contracted
        if a == nd - 1:
            return ("sum", "k")
        if a == nd - 2:
            return ("out", no - 2 if no >= 2 else no - 1)
        return ("out", a + no - nd)
    # [..., k, m]: k contracted, columns land on -1
    if a == nd - 2:
        return ("sum", "k")
    if a == nd - 1:
        return ("out", no - 1)
    return ("out", a + no - nd)


def _einsum_place(args, t: Tensor, a: int) -> tuple[str, int | str] | None:
    """Where dim ``a`` of einsum operand ``t`` goes: ``("out", output dim)`` or ``("sum", letter)``."""
    found = einsum_letter(args, t, a)
    if found is None:
        return None
    letter, out = found
    return ("out", out.index(letter)) if letter in out else ("sum", letter)


def aligned(func, args: tuple, kwargs: dict, data: list[tuple[Any, Tensor, Any]], out: Tensor) -> tuple[Any, Any]:
    """``(how, axis)`` for an operation with several data arguments ``data`` (``(position,
    tensor, axis)``, axis None where unknown). ``how``: True when every argument that requires
    grad has its samples on one output dim, in the same rows (``axis`` is then the output's);
    ``"pooled"`` when they are all summed over one contracted index in the same rows (a sum of
    per-sample terms, ``h.T @ h``: no axis); False otherwise (the operation mixes samples;
    ``axis``: the output dim of the first argument whose samples land on one, or None)."""
    places = _places(func, args, data, out)
    first_axis = None
    for t, place, ax in places:
        if place is not None and place[0] == "out":
            first_axis = (place[1], ax[1]) if type(ax) is not Rows else ax.at(place[1])
            break
    grads = [(t, place, ax) for t, place, ax in places if t.requires_grad]
    if not grads:
        return True, first_axis
    if all(place is not None and place[0] == "sum" for _, place, _ in grads):
        ref = grads[0]
        for t, place, ax in places:  # every data argument summed over the same index, same rows
            if place is None or place != ref[1] or not unify((0, ax[1]) if type(ax) is not Rows else ax.at(0),
                                                                 (0, ref[2][1]) if type(ref[2]) is not Rows else ref[2].at(0)):
                return False, first_axis
        return "pooled", None
    ref = None
    for t, place, ax in grads:
        if place is None or place[0] != "out":
            return False, first_axis
        here = (place[1], ax[1]) if type(ax) is not Rows else ax.at(place[1])
        if ref is None:
            ref = here
        elif not unify(ref, here):
            return False, first_axis
    # data arguments without grad whose samples sit elsewhere do not mix gradients
    return True, ref


def pairwise(func, args: tuple, data: list[tuple[Any, Tensor, Any]], out: Tensor) -> bool:
    """Whether a product of several data arguments puts the samples of its arguments that
    require grad on two or more different output dims: ``a @ b.T`` (a CLIP / SigLIP logit
    matrix), ``cdist(a, b)``. Its entries are pairs of samples: no dim of it is one sample's."""
    if getattr(func, "__name__", "") not in CONTRACTIONS:
        return False
    dims = {place[1] for t, place, _ in _places(func, args, [d for d in data if d[2] is not None], out)
            if t.requires_grad and place is not None and place[0] == "out"}
    return len(dims) > 1


def _places(func, args: tuple, data: list[tuple[Any, Tensor, Any]], out: Tensor) -> list:
    """``[(tensor, place, axis)]``: where each data argument's sample dim lands in ``out``
    (``("out", dim)``, ``("sum", index)``, ``("lost", -1)``, or None where not followed)."""
    name = getattr(func, "__name__", "")
    places = []
    for pos, t, ax in data:
        if ax is None:
            places.append((t, None, ax))
            continue
        a, f = ax
        if name in CONTRACTIONS:
            if name == "einsum":
                place = _einsum_place(args, t, a)
            elif name in ("cdist", "cosine_similarity", "pairwise_distance", "bilinear", "dot", "vdot",
                          "inner", "outer", "ger", "kron", "tensordot", "chain_matmul"):
                place = None
                if name in ("cdist",) and isinstance(pos, int):  # x1 rows -> -2, x2 rows -> -1
                    nd = t.dim()
                    if a == nd - 1:
                        place = ("lost", -1)
                    elif a == nd - 2:
                        place = ("out", out.dim() - 2 + pos)
                    else:
                        place = ("out", a + out.dim() - nd)
            else:
                place = _matmul_place(pos if isinstance(pos, int) else 0, t, a, out, name, len(args))
        else:  # elementwise, broadcast from the right
            r = a + out.dim() - t.dim()
            place = ("out", r) if 0 <= r < out.dim() and out.shape[r] == t.shape[a] else ("lost", -1)
        places.append((t, place, ax))
    return places


def describe(func, data: list[tuple[Any, Tensor, Any]]) -> str:
    """``name of [shapes]`` for an error."""
    name = getattr(func, "__name__", str(func))
    shapes = ", ".join(str(list(t.shape)) for _, t, _ in data)
    return f"{name} of tensors {shapes}"

