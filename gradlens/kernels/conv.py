"""Kernels of convolutions: ``nn.Conv2d`` through unfold + bmm (:class:`Conv2dKernel`), any
convolution through ``torch.func.vmap`` of its weight VJP (:class:`VmapConvKernel`: string
padding, ``output_padding``), and the convolutions' cross-micro-step maths (:class:`_ConvMaths`,
also used by :class:`gradlens.kernels.backpack.BackpackConvKernel`). String padding (``"same"``,
``"valid"``) becomes explicit, possibly asymmetric, pads (:func:`_explicit_padding`).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradlens import compat
from gradlens.core.param_shapes import full_shape
from gradlens.kernels.base import Kernel, _by_columns, _with_bias_column, tgram_cheaper

__all__ = ["Conv2dKernel", "VmapConvKernel"]


class _ConvMaths:
    """Cross-micro-step maths of convolutions (``kind = "conv"``: a ``_conv_forward`` along a
    direction), mixed in before :class:`Kernel`; transposed convolutions keep the base versions
    (:class:`gradlens.kernels.backpack.BackpackKernel`, :class:`VmapConvKernel`)."""

    kind: ClassVar[str] = "conv"

    def matrix_dims(self, module):
        if module.groups != 1:  # no single matrix: one sketch block per attribute
            return super().matrix_dims(module)
        return module.out_channels, full_shape(module.weight)[1:].numel()

    def positions(self, module, a, delta):
        return delta[0, 0].numel()

    def directional(self, module, a, delta, direction, attrs):
        D = {key: v.to(delta.dtype) for key, v in direction.items()}
        out = delta.new_zeros(delta.shape[0])
        if "weight" in D:
            out = out + (delta * compat.conv_forward(module, a, D["weight"], None)).flatten(1).sum(1)
        if "bias" in D:
            out = out + delta.flatten(2).sum(2) @ D["bias"]
        return out

    def sketch_factors(self, module, a, delta, attrs, u, vw, vb):
        ud = torch.einsum("kc,bct->bkt", u, delta.flatten(2))
        va = 0
        if "weight" in attrs:
            va = compat.conv_forward(module, a, vw.reshape(-1, *full_shape(module.weight)[1:]), None).flatten(2)
        if "bias" in attrs:
            va = va + vb[None, :, None]
        return (ud * va).sum(2)


def _explicit_padding(module: nn.Module, a: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    """``(input, padding)`` with integer padding for a Conv whose ``padding`` may be
    ``"valid"`` or ``"same"``: "same" pads ``d * (k - 1)`` per spatial dim, the extra element
    (odd total) on the right/bottom as ``F.conv*d`` does; asymmetric pads are applied to the
    input and the returned padding is 0 there."""
    pad = module.padding
    nd = len(module.kernel_size)
    if not isinstance(pad, str):
        return a, tuple(pad)
    if pad == "valid":
        return a, (0,) * nd
    totals = [d * (k - 1) for d, k in zip(module.dilation, module.kernel_size)]
    if all(t % 2 == 0 for t in totals):
        return a, tuple(t // 2 for t in totals)
    pads: list[int] = []  # F.pad order: last dim first, (left, right)
    for t in reversed(totals):
        pads += [t // 2, t - t // 2]
    return F.pad(a, pads), (0,) * nd


def _standard_strides(t: Tensor) -> Tensor:
    """``t`` with row-major strides on every axis, size-1 axes included (a copy only if needed)."""
    want, step = [], 1
    for size in reversed(t.shape):
        want.append(step)
        step *= size
    if t.stride() == tuple(reversed(want)):
        return t
    return t.clone(memory_format=torch.contiguous_format)


class VmapConvKernel(Kernel):
    """Any ``nn.Conv{1,2,3}d`` / ``nn.ConvTranspose{1,2,3}d`` (every padding, stride, dilation,
    group, ``output_padding``): g_n of the weight is the VJP of this one convolution at sample
    n, for all samples at once with ``torch.func.vmap``; the bias gradient is delta summed over
    the spatial positions. ``[b, *param]`` per slice, in per-sample units."""

    def per_sample(self, module, a, delta, start, stop, attrs=None):
        from torch.func import vjp, vmap

        names = self.params(module) if attrs is None else attrs
        # fresh standard strides: a length-1 axis may carry any stride (a [B, 1, C] sequence
        # transposed for the conv counts as contiguous), which the batched conv backward refuses
        x, d = _standard_strides(a[start:stop]), _standard_strides(delta[start:stop])
        out = {}
        if "weight" in names:
            transposed = isinstance(module, compat.ConvTransposeBase)
            nd = len(module.kernel_size)

            def conv(xi: Tensor, w: Tensor) -> Tensor:
                if transposed:
                    fn = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[nd - 1]
                    return fn(xi, w, None, module.stride, module.padding, module.output_padding,
                              module.groups, module.dilation)
                fn = (F.conv1d, F.conv2d, F.conv3d)[nd - 1]
                return fn(xi, w, None, module.stride, module.padding, module.dilation, module.groups)

            weight = module.weight.detach().to(d.dtype)

            def one(xi: Tensor, di: Tensor) -> Tensor:
                _, pullback = vjp(lambda w: conv(xi.unsqueeze(0), w), weight)
                return pullback(di.unsqueeze(0))[0]

            out["weight"] = vmap(one)(x.to(d.dtype), d)
        if "bias" in names and module.bias is not None:
            out["bias"] = d.flatten(2).sum(2)
        return out


class Conv2dKernel(_ConvMaths, Kernel):
    """``nn.Conv2d`` (groups=1, zero padding): per-sample gradients via unfold + bmm."""

    def per_sample(self, module, a, delta, start, stop, attrs=None):
        a, padding = _explicit_padding(module, a)
        x = F.unfold(
            a[start:stop], module.kernel_size, module.dilation, padding, module.stride
        )  # [b, C_in*kh*kw, T]
        d = delta[start:stop].flatten(2)  # [b, C_out, T]
        out = {"weight": torch.bmm(d, x.transpose(1, 2)).view(-1, *full_shape(module.weight))}
        if module.bias is not None:
            out["bias"] = d.sum(2)
        return {n: out[n] for n in self.params(module)}

    def entries(self, module, a, delta, attr, j):
        d = delta.flatten(2)  # [B, C_out, L]
        width = d.shape[0] * d.shape[2]
        if attr == "bias":
            return d.index_select(1, j).sum(-1)
        a, padding = _explicit_padding(module, a)
        if any(padding):
            ph, pw = padding
            a = F.pad(a, (pw, pw, ph, ph))
        c_out, c_per, kh, kw = full_shape(module.weight)
        co, r = j // (c_per * kh * kw), j % (c_per * kh * kw)
        c_in = (co // (c_out // module.groups)) * c_per + r // (kh * kw)
        ki, kj = (r // kw) % kh, r % kw
        (sh, sw), (dh, dw) = module.stride, module.dilation
        ho, wo = delta.shape[2:]
        st = a.stride()
        # a view of every input patch: [B, C_in, kh, kw, H_out, W_out], no copy
        patches = a.as_strided((a.shape[0], a.shape[1], kh, kw, ho, wo),
                               (st[0], st[1], st[2] * dh, st[3] * dw, st[2] * sh, st[3] * sw))
        return _by_columns(
            lambda ck, ik, jk, ok: (patches[:, ck, ik, jk].flatten(2) * d.index_select(1, ok)).sum(-1),
            c_in, ki, kj, co, width=width,
        )

    def seq_factors(self, module, a, delta, attrs):
        if module.groups != 1:
            return None
        a, padding = _explicit_padding(module, a)
        x = F.unfold(a, module.kernel_size, module.dilation, padding, module.stride)
        return _with_bias_column(x.transpose(1, 2), attrs), delta.flatten(2).transpose(1, 2)

    def use_tgram(self, module, a, delta, n=None):
        dims = self.matrix_dims(module)
        if dims is None:
            return False
        return tgram_cheaper(dims[0], dims[1], self.positions(module, a, delta), n)

    def grad_sum(self, module, a, delta):
        d = delta
        out = {}
        names = self.params(module)
        if "weight" in names:
            a, padding = _explicit_padding(module, a)
            out["weight"] = torch.nn.grad.conv2d_weight(
                a, full_shape(module.weight), d, module.stride, padding, module.dilation
            )
        if "bias" in names:
            out["bias"] = d.sum((0, 2, 3))
        return out
