"""Indexed writes along the samples' dim (``index_put``, ``index_copy``, ``index_add``,
``scatter``, ``target[idx] = value``): which sample each row of the result holds, for the rules
of :mod:`gradlens.capture.samples` (a MoE block's ``final.index_add_(0, token_idx, expert_out)``
puts each routed token's rows back in its own sample's row)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gradlens.capture.axes import _dim, _int_arg
from gradlens.capture.rows import Mix, Rows, owner_of, rows_axis, unify

__all__: list[str] = []


def _mark(marks, t):
    if marks is None or not isinstance(t, Tensor):
        return False, None
    e = marks._d.get(id(t))
    if e is None or e[0]() is not t:
        return False, None
    return True, e[1]


def _write_rows(target_own: Tensor | None, index: Tensor, src_own: Tensor, accumulate: bool, batch: int,
                dim: int, what: str, grads: bool, kept: Any) -> list:
    """The rows of an indexed write along the sample dim (``index_put``, ``index_copy``,
    ``index_add``, ``__setitem__``): row ``index[k]`` takes source row k; the other rows keep the
    target's. Rows that end up holding several samples mix them; rows of no sample (a constant
    target) are not followed."""
    n = target_own.numel() if target_own is not None else None
    if index.dtype == torch.bool:
        index = index.nonzero().reshape(-1)
    index = index.reshape(-1).to(src_own.device)
    if index.numel() != src_own.numel():
        return [None]
    size = n if n is not None else int(index.max()) + 1 if index.numel() else 0
    out = torch.full((size,), -1, dtype=torch.int64, device=src_own.device)
    out[index] = src_own
    if not bool((out[index] == src_own).all()):  # two samples written into one row
        return [Mix(kept, what + " (several samples into one row)")] if grads else [None]
    if target_own is not None:
        written = out >= 0
        if accumulate and bool((written & (out != target_own)).any()):
            return [Mix(kept, what + " (added into another sample's row)")] if grads else [None]
        out = torch.where(written, out, target_own)
    if bool((out < 0).any()):
        return [None]  # rows of no sample
    return [rows_axis(dim, out, batch)]


def _index_write(name, func, args, kwargs, x, ax, outs, batch, got, marks):
    """``index_put`` / ``index_copy`` / ``index_add`` / ``scatter`` along the sample dim."""
    if name in ("index_put", "index_put_"):
        target, indices = args[0], _int_arg(args, kwargs, 1, "indices")
        src, dim = _int_arg(args, kwargs, 2, "values"), 0
        acc = bool(_int_arg(args, kwargs, 3, "accumulate", False))
        if not isinstance(indices, (tuple, list)) or len(indices) != 1 or not isinstance(indices[0], Tensor):
            return None
        index = indices[0]
    elif name in ("scatter", "scatter_", "scatter_add", "scatter_add_"):
        target, dim = args[0], _int_arg(args, kwargs, 1, "dim")
        index, src = _int_arg(args, kwargs, 2, "index"), _int_arg(args, kwargs, 3, "src")
        acc = "add" in name or bool(kwargs.get("reduce"))
        if not isinstance(index, Tensor) or not isinstance(src, Tensor):
            return None
        d = _dim(dim, target.dim())
        t_data, t_ax = (True, ax) if target is x else _mark(marks, target)
        if t_data and t_ax is not None and t_ax[0] != d:  # written along another dim (a router's
            s_data, s_ax = (True, ax) if src is x else _mark(marks, src)  # scores per expert)
            if not s_data or (s_ax is not None and s_ax[0] == t_ax[0] and unify(s_ax, t_ax)):
                return None  # each sample's rows take its own values: carry's answer
            return [Mix(got[0] if got else None, f"torch.{name} of values whose samples are in other rows")] \
                if src.requires_grad else [None]
        first = index
        for k in range(index.dim()):
            if k != d and first.shape[k] > 1:
                first = first.narrow(k, 0, 1)
        if index.numel() and not bool((index == first).all()):
            return [Mix(got[0] if got else None, f"torch.{name} with another row per column")] if src.requires_grad else [None]
        index = first.reshape(-1)
        src_rows = index.numel()
        src = src.narrow(d, 0, src_rows) if src.shape[d] != src_rows else src
    else:  # index_copy / index_add (x, dim, index, source)
        target, dim = args[0], _int_arg(args, kwargs, 1, "dim")
        index, src = _int_arg(args, kwargs, 2, "index"), _int_arg(args, kwargs, 3, "source")
        acc = "add" in name
    if not isinstance(src, Tensor) or not isinstance(index, Tensor):
        return None
    d = _dim(dim, target.dim())
    t_data, t_ax = (True, ax) if target is x else _mark(marks, target)
    s_data, s_ax = (True, ax) if src is x else _mark(marks, src)
    if not s_data or s_ax is None or s_ax[0] != d or (t_data and (t_ax is None or t_ax[0] != d)):
        if t_data and t_ax is not None and t_ax[0] != d:
            return None  # written along another dim: the samples' rows stay
        return [None]
    src_own = owner_of(s_ax, src.shape[d], batch, x.device)
    tgt_own = owner_of(t_ax, target.shape[d], batch, x.device) if t_data else None
    if src_own is None or (t_data and tgt_own is None):
        return [None]
    if not t_data and index.dtype != torch.bool:
        tgt_rows = target.shape[d]
        out = _write_rows(None, index, src_own, acc, batch, d, f"torch.{name} along the samples",
                          src.requires_grad, got[0] if got else None)
        if out[0] is None or out[0].__class__ is Mix:
            return out
        own = owner_of(out[0], tgt_rows, batch, x.device) if type(out[0]) is not Rows else out[0].owner
        return [out[0]] if own is not None and own.numel() == tgt_rows else [None]
    return _write_rows(tgt_own, index, src_own, acc, batch, d, f"torch.{name} along the samples",
                       src.requires_grad, got[0] if got else None)


def _setitem(name, func, args, kwargs, x, ax, outs, batch, got, marks):
    """``target[idx] = value`` (in place: the capture passes the target as the output)."""
    target, idx, value = args[0], args[1], args[2] if len(args) > 2 else None
    comps = idx if isinstance(idx, tuple) else (idx,)
    if not isinstance(value, Tensor) or len(comps) != 1:
        return None
    t_data, t_ax = (True, ax) if target is x else _mark(marks, target)
    v_data, v_ax = (True, ax) if value is x else _mark(marks, value)
    if not v_data:
        return None if t_data else [None]
    if v_ax is None or v_ax[0] != 0 or (t_data and (t_ax is None or t_ax[0] != 0)):
        return [None]
    c = comps[0]
    if isinstance(c, slice):
        c = torch.arange(target.shape[0], device=x.device)[c]
    if not isinstance(c, Tensor) or c.dim() != 1:
        return [None]
    src_own = owner_of(v_ax, value.shape[0], batch, x.device)
    tgt_own = owner_of(t_ax, target.shape[0], batch, x.device) if t_data else None
    if src_own is None:
        return [None]
    if tgt_own is None:
        tgt_own = torch.full((target.shape[0],), -1, dtype=torch.int64, device=x.device)
    return _write_rows(tgt_own, c, src_own, False, batch, 0, "an indexed write along the samples",
                       value.requires_grad, got[0] if got else None)
