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

Samples are on dim 0 of the layer input, one row each (``[B, d]``, ``[B, *, d]``, a Conv2d's ``[B,
C, H, W]``): the caller checks that before choosing this route. The layers: torch's ``Linear``,
``Conv2d`` (groups 1, zero padding), ``LayerNorm`` (affine), ``Embedding`` and transformers'
``Conv1D`` (matched by its dotted name, :data:`CONV1D`: no import). ``forward_for`` gives the
replacement forward of a module whose probes are its attributes ``_gradlens_probe`` (the probe) and
``_gradlens_sq`` (a tuple of ``sq`` tensors, or ``None``).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradlens.kernels.base import qualname

__all__ = ["CONV1D", "PROBED", "forward_for", "probe_width", "probed_class"]


def _flat(t: Tensor) -> Tensor:
    """``[B, *, d] -> [B, T, d]`` (``T`` the product of the middle dims; 1 for ``[B, d]``)."""
    return t.reshape(t.shape[0], -1, t.shape[-1])


def _linear_stats(a: Tensor, d: Tensor, squares: bool, numel: int) -> tuple[Tensor, Tensor | None]:
    """Per sample ``n`` (rows ``t``) of ``G_n = sum_t delta_t a_t^T`` (``a [B, T, in]``, ``d [B,
    T, out]``): ``||G_n||^2 [B]`` and, if ``squares``, ``sum_n G_n^2 [out, in]`` (else None).
    ``||delta_n||^2 ||a_n||^2`` for one row, else the Gram form ``sum_{t,t'} (delta_t.delta_t')
    (a_t.a_t')`` (``[B, T, T]``) or, where ``T^2`` exceeds ``numel`` (the weight's size) or the
    sum of squares is wanted, ``G_n [B, out, in]`` itself."""
    if a.shape[1] == 1:
        d2, a2 = d[:, 0] * d[:, 0], a[:, 0] * a[:, 0]
        return d2.sum(1) * a2.sum(1), (d2.t() @ a2 if squares else None)
    if squares or a.shape[1] ** 2 > numel:
        g = torch.einsum("bto,bti->boi", d, a)  # [B, out, in]
        return (g * g).sum((1, 2)), ((g * g).sum(0) if squares else None)
    return (torch.bmm(d, d.transpose(1, 2)) * torch.bmm(a, a.transpose(1, 2))).sum((1, 2)), None


def _bias_stats(d: Tensor, squares: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """``d [B, T, out]``: the bias' gradient ``[out]``, ``||dL_n/db||^2 [B]`` and, if
    ``squares``, ``sum_n (dL_n/db)^2 [out]``."""
    s = d.sum(1)  # [B, out]
    return s.sum(0), (s * s).sum(1), ((s * s).sum(0) if squares else None)


def _keep(ctx, inputs: tuple) -> None:
    """What the backward of a probed layer with a weight needs from ``(x, weight, bias, probe,
    sq_weight, sq_bias, ...)``: x and the weight saved, whether there is a bias, and whether
    sums of squares are wanted."""
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.has_bias, ctx.squares = inputs[2] is not None, inputs[4] is not None


class _ProbedLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` (``weight [out, in]``); probe columns: weight, then bias
    (if any); the per-sample forms of :func:`_linear_stats`."""

    @staticmethod
    def forward(x, weight, bias, probe, sq_w, sq_b):
        return F.linear(x, weight, bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _keep(ctx, inputs)

    @staticmethod
    def backward(ctx, go):
        x, weight = ctx.saved_tensors
        a, d = _flat(x), _flat(go)  # [B, T, in], [B, T, out]
        l2, sq_w = _linear_stats(a, d, ctx.squares, weight.numel())
        cols, sq_b, gb = [l2], None, None
        if ctx.has_bias:
            gb, l2_b, sq_b = _bias_stats(d, ctx.squares)
            cols.append(l2_b)
        gw = torch.einsum("bto,bti->oi", d, a)
        return go @ weight, gw, gb, torch.stack(cols, 1), sq_w, sq_b


class _ProbedConv1D(torch.autograd.Function):
    """Hugging Face ``transformers``' ``Conv1D``: ``x @ weight + bias`` with ``weight [in, out]``
    (GPT-2's layers; ``bias [out]`` always); probe columns: weight, bias. The forms of
    :func:`_linear_stats` (whose ``[out, in]`` sum of squares is returned transposed)."""

    @staticmethod
    def forward(x, weight, bias, probe, sq_w, sq_b):
        return torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[1])

    @staticmethod
    def setup_context(ctx, inputs, output):
        _keep(ctx, inputs)

    @staticmethod
    def backward(ctx, go):
        x, weight = ctx.saved_tensors
        a, d = _flat(x), _flat(go)  # [B, T, in], [B, T, out]
        l2, sq_w = _linear_stats(a, d, ctx.squares, weight.numel())
        gb, l2_b, sq_b = _bias_stats(d, ctx.squares)
        gw = torch.einsum("bti,bto->io", a, d)
        return (go @ weight.t(), gw, gb, torch.stack([l2, l2_b], 1),
                None if sq_w is None else sq_w.t(), sq_b)


class _ProbedConv2d(torch.autograd.Function):
    """``F.conv2d(x, weight, bias, stride, padding, dilation)`` (groups 1, zero padding given as
    integers); probe columns: weight, then bias (if any). The input unfolded, ``U = unfold(x)
    [B, C_in kh kw, L]``, makes the layer a Linear over the ``L`` output positions (``G_n =
    delta_n U_n^T``, ``delta_n [C_out, L]``): the forms of :func:`_linear_stats` (as the eager
    :class:`gradlens.kernels.conv.Conv2dKernel`)."""

    @staticmethod
    def forward(x, weight, bias, probe, sq_w, sq_b, stride, padding, dilation):
        return F.conv2d(x, weight, bias, stride, padding, dilation)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _keep(ctx, inputs)
        ctx.conv = tuple(inputs[6:9])  # (stride, padding, dilation)

    @staticmethod
    def backward(ctx, go):
        x, weight = ctx.saved_tensors
        stride, padding, dilation = ctx.conv
        gx = torch.nn.grad.conv2d_input(x.shape, weight, go, stride, padding, dilation)
        u = F.unfold(x, weight.shape[2:], dilation, padding, stride)  # [B, C_in kh kw, L]
        a, d = u.transpose(1, 2), go.flatten(2).transpose(1, 2)  # [B, L, C_in kh kw], [B, L, C_out]
        l2, sq_w = _linear_stats(a, d, ctx.squares, weight.numel())
        cols, sq_b, gb = [l2], None, None
        if ctx.has_bias:
            gb, l2_b, sq_b = _bias_stats(d, ctx.squares)
            cols.append(l2_b)
        gw = torch.einsum("blo,bli->oi", d, a).reshape(weight.shape)
        return (gx, gw, gb, torch.stack(cols, 1), None if sq_w is None else sq_w.reshape(weight.shape), sq_b,
                None, None, None)


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
        _keep(ctx, inputs)

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


def _pair(sq: tuple | None) -> tuple:
    """``(sq_weight, sq_bias)`` of a layer's ``sq`` tensors (None each where not made; a layer
    without bias has one: the same tensor given twice would break dynamo's graph)."""
    if sq is None:
        return None, None
    return sq[0], (sq[1] if len(sq) > 1 else None)


def _weight_bias_forward(function: type, extra: tuple[str, ...] = ()) -> Callable[[nn.Module], Callable]:
    """The probed forward of a layer with ``weight`` and ``bias`` taken through ``function``
    (an autograd Function applied to ``(x, weight, bias, probe, sq_weight, sq_bias, *extra)``,
    ``extra`` named attributes of the layer): a factory of one forward per layer."""
    def make(mod: nn.Module) -> Callable[[Tensor], Tensor]:
        def forward(x: Tensor) -> Tensor:
            if mod._gradlens_probe is None:  # a call that is no forward of the compiled model: its own op
                return type(mod).forward(mod, x)
            sq = _pair(mod._gradlens_sq)
            return function.apply(x, mod.weight, mod.bias, mod._gradlens_probe, sq[0], sq[1],
                                  *(getattr(mod, a) for a in extra))

        return forward

    return make


_linear_forward = _weight_bias_forward(_ProbedLinear)
_conv1d_forward = _weight_bias_forward(_ProbedConv1D)
_conv2d_forward = _weight_bias_forward(_ProbedConv2d, ("stride", "padding", "dilation"))


def _layer_norm_forward(mod: nn.LayerNorm) -> Callable[[Tensor], Tensor]:
    def forward(x: Tensor) -> Tensor:
        if mod._gradlens_probe is None:  # a call that is no forward of the compiled model: its own op
            return type(mod).forward(mod, x)
        sq = _pair(mod._gradlens_sq)
        xhat = F.layer_norm(x, mod.normalized_shape, None, None, mod.eps)
        return _ProbedAffine.apply(xhat, mod.weight, mod.bias, mod._gradlens_probe, sq[0], sq[1])

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


def _conv1d_ok(mod: nn.Module) -> bool:
    return mod.bias is not None and mod.weight.dim() == 2


def _conv2d_ok(mod: nn.Module) -> bool:
    return mod.groups == 1 and mod.padding_mode == "zeros" and not isinstance(mod.padding, str)


def _layer_norm_ok(mod: nn.Module) -> bool:
    return mod.weight is not None  # (elementwise_affine; bias may be None)


def _embedding_ok(mod: nn.Module) -> bool:
    return mod.max_norm is None and not mod.sparse and not mod.scale_grad_by_freq


#: transformers' ``Conv1D`` (matched by name: gradlens does not import transformers)
CONV1D = "transformers.pytorch_utils.Conv1D"

#: the layer classes of the compiled route: class (or its dotted name) -> (whether a module of
#: it qualifies, its replacement forward, its parameters in probe-column order)
PROBED: dict[type | str, tuple[Callable[[nn.Module], bool], Callable[[nn.Module], Callable], tuple[str, ...]]] = {
    nn.Linear: (_linear_ok, _linear_forward, ("weight", "bias")),
    CONV1D: (_conv1d_ok, _conv1d_forward, ("weight", "bias")),
    nn.Conv2d: (_conv2d_ok, _conv2d_forward, ("weight", "bias")),
    nn.LayerNorm: (_layer_norm_ok, _layer_norm_forward, ("weight", "bias")),
    nn.Embedding: (_embedding_ok, _embedding_forward, ("weight",)),
}


def _entry(mod: nn.Module) -> tuple | None:
    """The :data:`PROBED` entry of ``mod``'s class (exactly that class), or None."""
    cls = type(mod)
    return PROBED.get(cls) or PROBED.get(qualname(cls))


def probed_class(mod: nn.Module) -> bool:
    """``mod`` is exactly of a :data:`PROBED` class (whatever its settings)."""
    return _entry(mod) is not None


def probe_width(mod: nn.Module) -> list[str]:
    """The attributes of ``mod`` that its probe's columns measure, in order."""
    return [attr for attr in _entry(mod)[2] if getattr(mod, attr, None) is not None]


def forward_for(mod: nn.Module) -> Callable[[Tensor], Tensor] | None:
    """The probed forward of ``mod`` (exactly one of the :data:`PROBED` classes, with the
    settings it handles), or None."""
    entry = _entry(mod)
    if entry is None or not entry[0](mod):
        return None
    return entry[1](mod)
