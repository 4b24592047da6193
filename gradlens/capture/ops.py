"""Per-operation rules: the exact per-sample gradient of a parameter (or of a tensor computed from
parameters only) that an operation combines with the batch.

An operation ``out = f(..., t, ..., x, ...)`` with ``t`` a tracked parameter or a tensor derived
from parameters only, and ``x`` carrying the samples, receives ``delta = dL/d out`` (rescaled to
per-sample units, sample axis ``b``). Sample n's gradient with respect to ``t`` is the
vector-Jacobian product of ``f`` with ``delta`` restricted to sample n. Rules:

- ``add``/``sub`` (and their in-place and operator forms): ``delta_n`` summed over the axes along
  which ``t`` was broadcast;
- ``mul``: ``delta_n * other_n`` summed likewise;
- ``F.linear`` with a derived weight: ``sum_t delta_nt a_nt^T`` (bias: ``sum_t delta_nt``);
- anything else: ``torch.func.vjp`` of that one operation, vmapped over the one-sample
  restrictions of ``delta`` (exact for any differentiable operation; costs B backward passes of
  that operation, in chunks).

A derived ``t`` is then taken back to its parameters with a batched VJP through the
parameters-only graph that produced it (``torch.autograd.grad(..., is_grads_batched=True)``), so
e.g. a position embedding looked up with ids of shape ``[1, T]`` and added to ``[B, T, d]`` token
embeddings gets exact per-sample gradients.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from gradlens import compat
from gradlens.core.param_shapes import full_shape
from gradlens.core.side import side_backward
from gradlens.kernels.base import CHUNK_ELEMENTS, sample_chunks  # the one chunking rule (re-exported)

__all__ = ["per_sample_wrt", "chain_to_params", "batched_lookup", "routed_lookup", "grouped_weight", "routed_factors",
           "rows_to_samples", "CHUNK_ELEMENTS"]


_ADD = {"add", "__add__", "__radd__", "__iadd__", "add_"}
_SUB = {"sub", "__sub__", "__isub__", "sub_", "subtract"}
_RSUB = {"__rsub__", "rsub"}
_MUL = {"mul", "__mul__", "__rmul__", "__imul__", "mul_", "multiply"}


def _name(func) -> str:
    return getattr(func, "__name__", "")


def _out_of_place(func: Callable) -> Callable:
    """The out-of-place form of an in-place operation (``add_`` -> ``torch.add``)."""
    name = _name(func)
    if name.startswith("__i") and name.endswith("__"):
        base = name[3:-2]
        return getattr(torch.Tensor, f"__{base}__")
    if name.endswith("_") and not name.endswith("__"):
        alt = getattr(torch, name[:-1], None) or getattr(torch.Tensor, name[:-1], None)
        if alt is not None:
            return alt
    return func


def is_inplace(func: Callable) -> bool:
    name = _name(func)
    return (name.startswith("__i") and name.endswith("__")) or (name.endswith("_") and not name.endswith("__"))


def _sum_to(g: Tensor, shape: torch.Size, b: int) -> Tensor | None:
    """``[B, *shape]``: per-sample ``g`` (sample axis ``b``) summed over the axes along which a
    tensor of ``shape`` was broadcast; None if that tensor itself spans the sample axis."""
    nd = g.dim()
    lead = nd - len(shape)
    if lead < 0:
        return None
    pos_b = b - lead  # the sample axis within ``shape`` (negative: not there)
    if pos_b >= 0 and shape[pos_b] != 1:
        return None
    gm = g.movedim(b, 0)
    # axes of gm (after the sample axis) and their sizes in ``shape``
    dims = []
    rest = [d for d in range(nd) if d != b]
    for i, d in enumerate(rest, start=1):
        k = d - lead
        if k < 0 or shape[k] == 1:
            dims.append(i)
    out = gm.sum(dims, keepdim=True) if dims else gm
    # drop the leading broadcast axes, put back the size-1 sample axis if ``shape`` has one
    out = out.reshape(out.shape[0], *[s for i, s in enumerate(out.shape[1:]) if rest[i] - lead >= 0])
    return out.reshape(out.shape[0], *shape)


def _generic(func, args, kwargs, pos, t: Tensor, delta: Tensor, b: int) -> Tensor:
    """``[B, *t.shape]``: vjp of this one operation with each one-sample restriction of delta."""
    f = _out_of_place(func)

    def call(x):
        a, kw = list(args), dict(kwargs)
        if isinstance(pos, str):  # a keyword argument
            kw[pos] = x
        else:
            _put(a, pos, x)
        return f(*a, **kw)

    _, vjp_fn = torch.func.vjp(call, t.detach())
    n = delta.shape[b]
    eye_shape = [1] * (delta.dim() + 1)
    parts = []
    for s, e in sample_chunks(delta.numel(), n):  # a chunk of samples x the whole output
        idx = torch.arange(s, e, device=delta.device)
        onehot = (idx[:, None] == torch.arange(n, device=delta.device)[None, :]).to(delta.dtype)
        shape = list(eye_shape)
        shape[0], shape[b + 1] = e - s, n
        masked = delta.unsqueeze(0) * onehot.reshape(shape)
        parts.append(torch.func.vmap(vjp_fn)(masked)[0])
    return torch.cat(parts)


def _put(a: list, pos, x) -> None:
    if isinstance(pos, tuple):  # (index in args, index in a list argument)
        lst = list(a[pos[0]])
        lst[pos[1]] = x
        a[pos[0]] = type(a[pos[0]])(lst) if isinstance(a[pos[0]], tuple) else lst
    elif isinstance(pos, str):
        raise AssertionError("keyword positions are substituted by the caller")
    else:
        a[pos] = x


def per_sample_wrt(
    func: Callable, args: tuple, kwargs: dict, pos: Any, t: Tensor, delta: Tensor, b: int
) -> Tensor:
    """``[B, *t.shape]``: per-sample gradients with respect to the input ``t`` (at ``pos`` in
    ``args``; ``(i, j)`` for element j of a list argument i) of ``out = func(*args, **kwargs)``
    given ``delta = dL/d out`` (per-sample units, sample axis ``b``)."""
    name = _name(func)
    binary = isinstance(pos, int) and pos in (0, 1) and len(args) >= 2
    other = args[1 - pos] if binary else None
    if binary and not isinstance(other, Tensor):
        other = torch.as_tensor(other, dtype=delta.dtype, device=delta.device)
    if binary and name in _ADD | _SUB | _RSUB:
        alpha = float(kwargs.get("alpha", 1.0))
        if name in _RSUB:  # other - self
            sign = -1.0 if pos == 0 else 1.0
        else:
            sign = 1.0 if pos == 0 else (alpha if name in _ADD else -alpha)
        got = _sum_to(delta, t.shape, b)
        if got is not None:
            return got if sign == 1.0 else got * sign
    if binary and name in _MUL:
        got = _sum_to(delta * other.to(delta.dtype), t.shape, b)
        if got is not None:
            return got
    if func is F.linear and pos in (1, 2):
        d = delta.movedim(b, 0)
        bsz = d.shape[0]
        d = d.reshape(bsz, -1, d.shape[-1])
        if pos == 2:
            return d.sum(1)
        x = args[0].movedim(b, 0).reshape(bsz, -1, args[0].shape[-1]).to(delta.dtype)
        return torch.bmm(d.transpose(1, 2), x)
    return _generic(func, args, kwargs, pos, t, delta, b)


def batched_lookup(func: Callable, args: tuple, kwargs: dict, pos: Any, t: Tensor, params: list[Tensor],
                   delta: Tensor, b: int) -> Tensor | None:
    """``[B, V, D]`` per-sample gradient of the table ``W`` of ``t = F.embedding(ids, W)`` when
    ``ids`` span the sample axis without being data (position ids expanded to ``[B, T]``), or
    have size 1 there and are broadcast over it (transformers' ``[1, T]`` position ids), and an
    elementwise ``add``/``sub``/``mul`` combines ``t`` with the batch; None otherwise.

    Sample n's gradient with respect to ``t`` is ``delta_n`` (times the other operand) in slice n
    (of a broadcast ``t``: its one slice) and zero elsewhere, so taken back through the lookup it
    is the scatter of that slice into the rows of sample n's ids: one ``index_add`` over all
    samples, without the ``[B, *t.shape]`` one-sample restrictions that :func:`per_sample_wrt`
    and :func:`chain_to_params` would form."""
    name = _name(func)
    if not (isinstance(pos, int) and pos in (0, 1) and len(args) >= 2) or len(params) != 1:
        return None
    if name not in _ADD | _SUB | _RSUB | _MUL or t.dim() != delta.dim() or t.shape[b] not in (1, delta.shape[b]):
        return None
    fn = t.grad_fn
    weight = params[0]
    if compat.node_name(fn) != "EmbeddingBackward0" or len(full_shape(weight)) != 2 or b >= t.dim() - 1:
        return None
    leaf = fn.next_functions[0][0] if fn.next_functions else None
    if getattr(leaf, "variable", None) is not weight:
        return None
    ids, pad, by_freq = compat.embedding_saved(fn)  # (once: each read unpacks the saved ids)
    if by_freq:
        return None
    if name in _MUL:
        other = args[1 - pos]
        if not isinstance(other, Tensor):
            other = torch.as_tensor(other, dtype=delta.dtype, device=delta.device)
        g = delta * other.to(delta.dtype)
    elif name in _RSUB:
        g = -delta if pos == 0 else delta
    elif name in _SUB and pos == 1:
        g = delta * -float(kwargs.get("alpha", 1.0))
    elif name in _ADD and pos == 1:
        alpha = float(kwargs.get("alpha", 1.0))
        g = delta if alpha == 1.0 else delta * alpha
    else:
        g = delta
    dims = [d for d in range(t.dim()) if d != b and t.shape[d] == 1 and g.shape[d] != 1]
    if dims:  # t broadcast along these axes (other than the sample axis: each sample its own)
        g = g.sum(dims, keepdim=True)
    n = delta.shape[b]
    if g.shape != t.shape[:b] + (n,) + t.shape[b + 1:]:
        return None
    if ids.shape != t.shape[:-1]:
        return None
    v, width = full_shape(weight)  # (ZeRO-3: the data may be an empty partition by now)
    if b:
        ids, g = ids.movedim(b, 0), g.movedim(b, 0)
    rows = ids.reshape(t.shape[b], -1) + torch.arange(0, n * v, v, device=ids.device).unsqueeze(1)
    out = g.new_zeros(n, v, width)
    out.view(n * v, width).index_add_(0, rows.reshape(-1), g.reshape(-1, width))
    if 0 <= pad < v:
        out[:, pad] = 0  # autograd gives the padding row no gradient
    return out


def _row_owner(use: Any, n_rows: int, device: Any) -> Tensor | None:
    """The sample of each of the ``n_rows`` rows on a use's sample axis (``use.rows``, or ``n``
    for rows ``n * f + j`` of a plain axis)."""
    if use.rows is not None:
        rows = use.rows.to(device)
        return rows if rows.numel() == n_rows else None
    if n_rows != use.batch * use.factor:
        return None
    idx = torch.arange(use.batch, device=device)
    return idx if use.factor == 1 else idx.repeat_interleave(use.factor)


def routed_lookup(use: Any, pos: Any, t: Tensor, delta: Tensor) -> Tensor | None:
    """``[B, *t.shape]``: per-sample gradients of a tensor ``t`` indexed by data ids, ``t[ids]``
    (transformers' batched experts: ``gate_up_proj[expert_ids]``, one weight per routed token),
    in closed form: row ``r`` of the output is slice ``ids[r]`` of ``t``, so sample n's gradient
    gathers ``delta_r`` of its own rows into those slices (one ``index_add`` over
    ``owner * E + ids``), without the per-row ``[R, *t.shape]`` of the generic rule. None where
    the call is not such a lookup."""
    if _name(use.func) != "__getitem__" or pos != 0 or len(use.args) < 2:
        return None
    ids = use.args[1]
    if not isinstance(ids, Tensor) or ids.dtype == torch.bool or ids.is_floating_point() or use.axis >= ids.dim():
        return None
    if delta.shape[:ids.dim()] != ids.shape or tuple(delta.shape[ids.dim():]) != tuple(t.shape[1:]):
        return None
    owner = _row_owner(use, ids.shape[use.axis], delta.device)
    if owner is None:
        return None
    shape = [1] * ids.dim()
    shape[use.axis] = owner.numel()
    owner = owner.view(shape).expand(ids.shape).reshape(-1)
    e = t.shape[0]
    flat_ids = ids.reshape(-1).to(delta.device) % e  # (negative ids count from the end)
    out = delta.new_zeros((use.batch * e,) + tuple(t.shape[1:]))
    out.index_add_(0, owner * e + flat_ids, delta.reshape((-1,) + tuple(t.shape[1:])))
    return out.view((use.batch,) + tuple(t.shape))


def grouped_weight(use: Any, pos: Any, t: Tensor, delta: Tensor) -> Tensor | None:
    """``[B, E, k, m]``: per-sample gradients of the weight ``t`` ``[E, k, m]`` of
    ``out = grouped_mm(x, t, offs=offs)`` (``x`` ``[S, k]``: rows ``offs[e-1]:offs[e]`` go
    through expert e; rows past ``offs[-1]`` through none), sample n's gradient for expert e being
    ``sum_r x_r^T delta_r`` over its rows of that group: outer products of chunks of rows
    (at most :data:`CHUNK_ELEMENTS` elements each) added into ``owner * E + group``. None where
    the call is not a 2-D x 3-D grouped product with offsets."""
    if _name(use.func) not in ("grouped_mm", "_grouped_mm") or pos != 1:
        return None
    x = use.args[0]
    offs = use.kwargs.get("offs", use.args[2] if len(use.args) > 2 else None)
    if not (isinstance(x, Tensor) and x.dim() == 2 and t.dim() == 3 and isinstance(offs, Tensor)) or use.axis != 0:
        return None
    if delta.dim() != 2 or delta.shape[0] != x.shape[0]:
        return None
    s = x.shape[0]
    owner = _row_owner(use, s, delta.device)
    if owner is None:
        return None
    e, k, m = t.shape
    group = torch.bucketize(torch.arange(s, device=delta.device), offs.to(delta.device).long(), right=True)
    keep = group < e  # rows past the last offset: of no expert
    x, d, owner, group = x[keep].to(delta.dtype), delta[keep], owner[keep], group[keep]
    out = delta.new_zeros(use.batch * e, k, m)
    step = max(1, CHUNK_ELEMENTS // max(1, k * m))
    for a in range(0, x.shape[0], step):
        b = min(a + step, x.shape[0])
        out.index_add_(0, owner[a:b] * e + group[a:b], x[a:b, :, None] * d[a:b, None, :])
    return out.view(use.batch, e, k, m)


def _slice_of(t: Tensor, param: Tensor) -> int | None:
    """e where ``t`` is the view ``param[e]`` of a 3-D ``param`` (a select along dim 0), else None."""
    if param.dim() != 3 or compat.view_base(t) is not param or tuple(t.shape) != tuple(param.shape[1:]):
        return None
    if tuple(t.stride()) != tuple(param.stride()[1:]) or param.stride(0) <= 0:
        return None
    off = t.storage_offset() - param.storage_offset()
    return off // param.stride(0) if off % param.stride(0) == 0 and 0 <= off < param.numel() else None


def routed_factors(use: Any, pos: Any, t: Tensor, param: Tensor, delta: Tensor) -> tuple | None:
    """``(owner [M], expert [M], u [M, p1], v [M, p2])``: the tokens of a routed expert use of
    the 3-D ``param [E, p1, p2]``, sample ``owner_m``'s gradient of slice ``expert_m`` gaining
    ``u_m v_m^T`` (the factored form of :mod:`gradlens.kernels.routed`), for
    ``F.linear(x, param[e])`` (u the output gradient, v the input; the loop over the experts)
    and ``grouped_mm(x, t, offs=offs)`` with ``t`` the parameter (u = x, v = delta) or its
    ``transpose(-2, -1)`` (u = delta, v = x); None for any other call."""
    name = _name(use.func)
    if param.dim() != 3 or tuple(full_shape(param)) != tuple(param.shape):
        return None
    if use.func is F.linear and pos == 1:
        e = _slice_of(t, param)
        x = use.args[0]
        if e is None or not isinstance(x, Tensor) or delta.shape[:-1] != x.shape[:-1] or use.axis >= x.dim() - 1:
            return None
        n_rows = x.shape[use.axis]
        owner = _row_owner(use, n_rows, delta.device)
        if owner is None:
            return None
        v = x.detach().movedim(use.axis, 0).reshape(n_rows, -1, x.shape[-1])
        u = delta.movedim(use.axis, 0).reshape(n_rows, -1, delta.shape[-1])
        owner = owner[:, None].expand(n_rows, u.shape[1]).reshape(-1)
        expert = torch.full_like(owner, e)
        return owner, expert, u.reshape(-1, u.shape[-1]), v.reshape(-1, v.shape[-1]).to(delta.dtype)
    if name in ("grouped_mm", "_grouped_mm") and pos == 1:
        x = use.args[0]
        offs = use.kwargs.get("offs", use.args[2] if len(use.args) > 2 else None)
        if not (isinstance(x, Tensor) and x.dim() == 2 and isinstance(offs, Tensor)) or use.axis != 0:
            return None
        if t is param:
            swap = False
        elif compat.view_base(t) is param and tuple(t.shape) == (param.shape[0], param.shape[2], param.shape[1]) \
                and tuple(t.stride()) == (param.stride(0), param.stride(2), param.stride(1)) \
                and t.storage_offset() == param.storage_offset():
            swap = True
        else:
            return None
        if delta.dim() != 2 or delta.shape[0] != x.shape[0]:
            return None
        owner = _row_owner(use, x.shape[0], delta.device)
        if owner is None:
            return None
        group = torch.bucketize(torch.arange(x.shape[0], device=delta.device), offs.to(delta.device).long(), right=True)
        keep = group < param.shape[0]  # rows past the last offset: of no expert
        xs, ds = x.detach()[keep].to(delta.dtype), delta[keep]
        return (owner[keep], group[keep]) + ((ds, xs) if swap else (xs, ds))
    return None


def chain_to_params(t: Tensor, params: list[Tensor], g: Tensor) -> list[Tensor | None]:
    """Per-sample gradients of the parameters that ``t`` was computed from (parameters only):
    ``g`` ``[B, *t.shape]`` taken back through that graph with one batched VJP. A lookup
    ``t = F.embedding(ids, weight)`` of ids that are not data (position ids, e.g.
    ``wpe(arange(T))``) is taken back in closed form instead: row ``ids[k]`` of sample n's
    gradient gathers ``g[n, k]`` (one ``index_add``; what the batched VJP computes, without
    its per-sample loop)."""
    direct = _embedding_lookup(t, params, g)
    if direct is not None:
        return [direct]
    with side_backward():  # the window's own parameter hooks stand aside (gradlens.core.side)
        if not _through_compiled(t.grad_fn):
            return list(
                torch.autograd.grad(
                    t, params, grad_outputs=g, is_grads_batched=True, retain_graph=True, allow_unused=True
                )
            )
        # a graph that torch.compile made (a forward traced with gradlens' hooks: the Lens got the
        # plain module of a compiled forward) has a compiled backward, which cannot be batched over
        # samples: one VJP per sample through it, stacked (exact; that window only, the next
        # tracked ones run eagerly)
        rows = [torch.autograd.grad(t, params, grad_outputs=g[n], retain_graph=True, allow_unused=True)
                for n in range(g.shape[0])]
    return [None if rows[0][i] is None else torch.stack([r[i] for r in rows]) for i in range(len(params))]


def _through_compiled(fn: Any) -> bool:
    """Whether the autograd graph from ``fn`` to its leaves (the parameters a derived tensor
    was computed from: a small graph) passes through a node of a ``torch.compile``'d graph."""
    seen, todo = set(), [fn]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if compat.is_compiled_node(node):
            return True
        todo.extend(nxt for nxt, _ in getattr(node, "next_functions", ()))
    return False


def _embedding_lookup(t: Tensor, params: list[Tensor], g: Tensor) -> Tensor | None:
    """``[B, V, D]`` per-sample gradient of the table if ``t`` is an embedding lookup of the
    one parameter, straight from its AccumulateGrad (else None)."""
    fn = t.grad_fn
    if len(params) != 1 or compat.node_name(fn) != "EmbeddingBackward0":
        return None
    weight = params[0]
    leaf = fn.next_functions[0][0] if fn.next_functions else None
    if getattr(leaf, "variable", None) is not weight or len(full_shape(weight)) != 2:
        return None
    ids, pad, by_freq = compat.embedding_saved(fn)
    if by_freq:
        return None
    b = g.shape[0]
    ids = ids.reshape(-1)
    shape = full_shape(weight)
    out = g.new_zeros(b, *shape)
    out.index_add_(1, ids, g.reshape(b, ids.numel(), shape[1]))
    if 0 <= pad < shape[0]:
        out[:, pad] = 0  # autograd gives the padding row no gradient
    return out


def rows_to_samples(g: Tensor, use: Any) -> Tensor:
    """``[B, *t]`` from per-row gradients ``g`` ``[R, *t]`` of a use whose rows are not the
    samples in order (``use.rows``: the sample of each row): sample n's gradient is the sum over
    its rows (none: zero)."""
    rows = use.rows.to(g.device)
    if rows.numel() and bool((rows < 0).any()):
        raise RuntimeError(
            f"gradlens cannot measure the use {use.name!r}: {int((rows < 0).sum())} of its rows hold no sample (a "
            "constant joined to the batch's rows that no sample's row met); leave its parameters out: "
            "Lens(..., exclude=[...])"
        )
    out = g.new_zeros((use.batch,) + tuple(g.shape[1:]))
    return out.index_add_(0, rows, g)
