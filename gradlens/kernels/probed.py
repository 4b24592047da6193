"""Layers whose per-sample statistics come back as the gradients of probe tensors: the compiled
route (:mod:`gradlens.measure.compiled_route`).

Each ``autograd.Function`` here computes its layer as usual and takes, besides the layer's
inputs, a zero ``probe [B, A]`` (``A``: the layer's parameters, weight then bias) and optionally
zero ``sq`` tensors shaped like the parameters. Its backward returns the ordinary gradients of
the input and the parameters and, as the probe's gradient, the per-sample squared norms of the
parameters' gradients ``||dL_n/dp||^2`` (column ``j``: parameter ``j``), and as each ``sq``'s
gradient ``sum_n (dL_n/dp)^2``; all in the units of the loss that was backpropagated (the
caller rescales). Everything is tensor algebra that ``torch.compile`` traces into the forward and
backward graphs: no hook, no mutation, no graph break.

Samples are on dim 0 of the layer input, one row each (``[B, d]`` or ``[B, *, d]``): the caller
checks that before choosing this route. ``forward_for`` gives the replacement forward of a
module whose probes are its attributes ``_gradlens_probe`` (the probe) and ``_gradlens_sq``
(a tuple of ``sq`` tensors, or ``None``).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["PROBED", "forward_for", "probe_width"]


def _flat(t: Tensor) -> Tensor:
    """``[B, *, d] -> [B, T, d]`` (``T`` the product of the middle dims; 1 for ``[B, d]``)."""
    return t.reshape(t.shape[0], -1, t.shape[-1])


class _ProbedLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)``; probe columns: weight, then bias (if any).

    Per sample ``n`` (rows ``t``): ``G_n = sum_t delta_t a_t^T``; ``||G_n||^2`` is
    ``||delta_n||^2 ||a_n||^2`` for one row, else ``sum_{t,t'} (delta_t.delta_t')(a_t.a_t')``
    (the Gram form, ``[B, T, T]``) or, where ``T^2`` exceeds the weight's size or the sum of
    squares is wanted, from ``G_n [B, out, in]`` itself."""

    @staticmethod
    def forward(x, weight, bias, probe, sq_w, sq_b):
        return F.linear(x, weight, bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, probe, sq_w, sq_b = inputs
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.squares = bias is not None, sq_w is not None

    @staticmethod
    def backward(ctx, go):
        x, weight = ctx.saved_tensors
        gx = go @ weight
        a, d = _flat(x), _flat(go)  # [B, T, in], [B, T, out]
        gw = torch.einsum("bto,bti->oi", d, a)
        cols, sq_w, sq_b, gb = [], None, None, None
        t = a.shape[1]
        if t == 1:
            d2 = (d[:, 0] * d[:, 0]).sum(1)
            cols.append(d2 * (a[:, 0] * a[:, 0]).sum(1))
            if ctx.squares:
                sq_w = (d[:, 0] * d[:, 0]).t() @ (a[:, 0] * a[:, 0])
        elif ctx.squares or t * t > weight.numel():
            g = torch.einsum("bto,bti->boi", d, a)  # [B, out, in]
            cols.append((g * g).sum((1, 2)))
            if ctx.squares:
                sq_w = (g * g).sum(0)
        else:
            cols.append((torch.bmm(d, d.transpose(1, 2)) * torch.bmm(a, a.transpose(1, 2))).sum((1, 2)))
        if ctx.has_bias:
            gb = d.sum((0, 1))
            s = d.sum(1)  # [B, out]
            cols.append((s * s).sum(1))
            if ctx.squares:
                sq_b = (s * s).sum(0)
        return gx, gw, gb, torch.stack(cols, 1), sq_w, sq_b


class _ProbedAffine(torch.autograd.Function):
    """The affine tail of a LayerNorm: ``xhat * weight + bias`` (``xhat`` normalised, weight
    and bias shaped like the normalised dims); probe columns: weight, then bias (if any).
    Per sample ``n``: ``dL_n/dweight = sum_t delta_t * xhat_t``, ``dL_n/dbias = sum_t delta_t``
    (``[B, *weight]``, small)."""

    @staticmethod
    def forward(xhat, weight, bias, probe, sq_w, sq_b):
        y = xhat * weight
        return y + bias if bias is not None else y

    @staticmethod
    def setup_context(ctx, inputs, output):
        xhat, weight, bias, probe, sq_w, sq_b = inputs
        ctx.save_for_backward(xhat, weight)
        ctx.has_bias, ctx.squares = bias is not None, sq_w is not None

    @staticmethod
    def backward(ctx, go):
        xhat, weight = ctx.saved_tensors
        b, k = go.shape[0], weight.numel()
        d = go.reshape(b, -1, k)
        gw_n = (d * xhat.reshape(b, -1, k)).sum(1)  # [B, k]
        cols, sq_w, sq_b, gb = [(gw_n * gw_n).sum(1)], None, None, None
        if ctx.squares:
            sq_w = (gw_n * gw_n).sum(0).reshape(weight.shape)
        if ctx.has_bias:
            gb_n = d.sum(1)
            gb = gb_n.sum(0).reshape(weight.shape)
            cols.append((gb_n * gb_n).sum(1))
            if ctx.squares:
                sq_b = (gb_n * gb_n).sum(0).reshape(weight.shape)
        return go * weight, gw_n.sum(0).reshape(weight.shape), gb, torch.stack(cols, 1), sq_w, sq_b


class _ProbedEmbedding(torch.autograd.Function):
    """``F.embedding(ids, weight, padding_idx)``; probe column: the table. Per sample ``n``:
    ``||dL_n/dW||^2 = sum_{t,t'} [id_t = id_t'] delta_t.delta_t'`` (``[B, T, T]``); the sum of
    squares ``sum_n (dL_n/dW)^2`` adds, into row ``id_t``, ``delta_t * sum_{t': id_t' = id_t}
    delta_t'`` (no ``[B, V, D]`` tensor)."""

    @staticmethod
    def forward(ids, weight, padding_idx, probe, sq_w):
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ids, weight, padding_idx, probe, sq_w = inputs
        ctx.save_for_backward(ids)
        ctx.padding_idx, ctx.squares, ctx.rows = padding_idx, sq_w is not None, weight.shape[0]

    @staticmethod
    def backward(ctx, go):
        (ids,) = ctx.saved_tensors
        b, dim = go.shape[0], go.shape[-1]
        idx, d = ids.reshape(b, -1), go.reshape(b, -1, dim)
        if ctx.padding_idx is not None:
            d = d * (idx != ctx.padding_idx).unsqueeze(-1).to(d.dtype)
        flat_idx, flat_d = idx.reshape(-1), d.reshape(-1, dim)
        gw = torch.zeros(ctx.rows, dim, dtype=go.dtype, device=go.device).index_add(0, flat_idx, flat_d)
        same = (idx.unsqueeze(2) == idx.unsqueeze(1)).to(d.dtype)  # [B, T, T]
        h = torch.bmm(same, d)  # [B, T, D]: sum of the sample's rows with the same index
        l2 = (d * h).sum((1, 2))
        sq_w = None
        if ctx.squares:
            sq_w = torch.zeros_like(gw).index_add(0, flat_idx, (d * h).reshape(-1, dim))
        return None, gw, None, l2.unsqueeze(1), sq_w


def _linear_forward(mod: nn.Linear) -> Callable[[Tensor], Tensor]:
    def forward(x: Tensor) -> Tensor:
        if mod._gradlens_probe is None:  # a call that is no forward of the compiled model: its own op
            return type(mod).forward(mod, x)
        sq = mod._gradlens_sq or (None, None)
        return _ProbedLinear.apply(x, mod.weight, mod.bias, mod._gradlens_probe, sq[0], sq[-1])

    return forward


def _layer_norm_forward(mod: nn.LayerNorm) -> Callable[[Tensor], Tensor]:
    def forward(x: Tensor) -> Tensor:
        if mod._gradlens_probe is None:  # a call that is no forward of the compiled model: its own op
            return type(mod).forward(mod, x)
        sq = mod._gradlens_sq or (None, None)
        xhat = F.layer_norm(x, mod.normalized_shape, None, None, mod.eps)
        return _ProbedAffine.apply(xhat, mod.weight, mod.bias, mod._gradlens_probe, sq[0], sq[-1])

    return forward


def _embedding_forward(mod: nn.Embedding) -> Callable[[Tensor], Tensor]:
    def forward(ids: Tensor) -> Tensor:
        if mod._gradlens_probe is None:  # a call that is no forward of the compiled model: its own op
            return type(mod).forward(mod, ids)
        sq = mod._gradlens_sq or (None,)
        return _ProbedEmbedding.apply(ids, mod.weight, mod.padding_idx, mod._gradlens_probe, sq[0])

    return forward


def _linear_ok(mod: nn.Module) -> bool:
    return True


def _layer_norm_ok(mod: nn.Module) -> bool:
    return mod.weight is not None  # (elementwise_affine; bias may be None)


def _embedding_ok(mod: nn.Module) -> bool:
    return mod.max_norm is None and not mod.sparse and not mod.scale_grad_by_freq


#: the layer classes of the compiled route: class -> (whether a module of it qualifies, its
#: replacement forward, its parameters in probe-column order)
PROBED: dict[type, tuple[Callable[[nn.Module], bool], Callable[[nn.Module], Callable], tuple[str, ...]]] = {
    nn.Linear: (_linear_ok, _linear_forward, ("weight", "bias")),
    nn.LayerNorm: (_layer_norm_ok, _layer_norm_forward, ("weight", "bias")),
    nn.Embedding: (_embedding_ok, _embedding_forward, ("weight",)),
}


def probe_width(mod: nn.Module) -> list[str]:
    """The attributes of ``mod`` that its probe's columns measure, in order."""
    return [attr for attr in PROBED[type(mod)][2] if getattr(mod, attr, None) is not None]


def forward_for(mod: nn.Module) -> Callable[[Tensor], Tensor] | None:
    """The probed forward of ``mod`` (exactly one of the :data:`PROBED` classes, with the
    settings it handles), or None."""
    entry = PROBED.get(type(mod))
    if entry is None or not entry[0](mod):
        return None
    return entry[1](mod)
