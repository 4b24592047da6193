"""The forwards a :class:`~gradlens.capture.tap.Tap` puts in place of a module's own during
tracked windows (:class:`_TrackedForward`): a Linear-like call fused with its measurement
(:class:`_FusedLinear`: its backward takes dL/dW from the per-sample weight gradients the Meter
formed anyway, above :data:`FUSE_MIN` multiply-adds), and the forward of a parameter-free
elementwise module run with the mode off (:func:`_elementwise_forward`). (Registered
tracked-window forwards: :mod:`gradlens.kernels.attention`, :mod:`gradlens.kernels.recurrent`.)"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradlens import compat
from gradlens.capture.events import WeightGrad
from gradlens.capture.registry import qualname
from gradlens.kernels.base import Kernel
from gradlens.core.limits import FUSE_MIN

__all__ = ["FUSE_MIN", "fused_forward_for"]


class _TrackedForward:
    """``module.forward`` during tracked windows (a registered tracked-window forward). A deep
    copy of the module taken meanwhile gets the module's own forward back."""

    def __init__(self, fwd: Callable, module: nn.Module, tap: "Tap"):
        self.fwd, self.module, self.tap = fwd, module, tap

    def __call__(self, *args, **kwargs):
        return self.fwd(self.module, self.tap, *args, **kwargs)

    def __deepcopy__(self, memo):
        copied = memo.get(id(self.module))
        return type(copied).forward.__get__(copied) if copied is not None else None


class _FusedLinear(torch.autograd.Function):
    """``F.linear`` whose backward takes dL/dW from its :class:`WeightGrad` when the Meter formed
    it (the output's hook, which measures the call, runs before this backward), so that the
    weight-gradient matmul is not computed twice. Input and bias gradients as ``F.linear``.
    ``transposed``: the weight is ``[d_in, d_out]`` (transformers' ``Conv1D``, ``y = x W + b``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, holder, transposed=False):
        ctx.save_for_backward(x, weight)
        ctx.holder, ctx.has_bias, ctx.transposed = holder, bias is not None, transposed
        if transposed:  # as Conv1D computes it: addmm of the rows with W
            out = x.reshape(-1, x.shape[-1])
            out = torch.mm(out, weight) if bias is None else torch.addmm(bias, out, weight)
            return out.view(*x.shape[:-1], weight.shape[1])
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = g.matmul(weight.t() if ctx.transposed else weight)
        if ctx.needs_input_grad[1]:
            gw, ctx.holder.value = ctx.holder.value, None
            if gw is None or torch.is_grad_enabled():
                # not measured (a shared weight, an empty batch), or a differentiable backward
                # (create_graph=True): what the layer's own backward does, so double backward works
                gw = x.reshape(-1, x.shape[-1]).t().mm(g2)
                gw = gw if ctx.transposed else gw.t()
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0)
        return gx, gw, gb, None, None


def _autocast(x: Tensor) -> bool:
    """Whether autocast is on for ``x``'s device (the fused call then steps aside: its backward
    would not see the dtypes autocast chose in forward)."""
    try:
        return torch.is_autocast_enabled(x.device.type)
    except TypeError:  # older torch: no device argument
        return torch.is_autocast_enabled()




def _fuses(module: nn.Module, tap: "Tap", x: Tensor, d_out: int) -> bool:
    """Whether a call of a Linear-like layer on ``x`` runs fused: a sequence input in a tracked
    forward, gradients on, no autocast, no torch.func transform, a weight gradient of at least
    :data:`FUSE_MIN` multiply-adds, and not small enough to be stacked (``tap.stacks_if``:
    measured with others like it at the window's end, which beats fusing; ``d_out`` the output
    width)."""
    return (tap._mode_depth and x.dim() > 2 and x.numel() * d_out >= FUSE_MIN and module.weight.requires_grad
            and x.dtype == module.weight.dtype and torch.is_grad_enabled() and not compat.in_functorch_transform()
            and not _autocast(x) and not (tap.stacks_if is not None and _stacks(module, tap, x, d_out)))


def _fused_forward(module: nn.Module, tap: "Tap", x: Tensor, transposed: bool = False) -> Tensor:
    """``nn.Linear.forward`` (``transposed``: transformers' ``Conv1D.forward``, ``x W + b`` with
    ``W [d_in, d_out]``) during tracked windows of a Lens that materialises the per-sample weight
    gradients of sequence inputs ``[B, T, d]`` anyway (sum of squares): where :func:`_fuses`
    says so, the call is a :class:`_FusedLinear` whose :class:`WeightGrad` rides on the output
    for the site hook; elsewhere the layer's own forward."""
    if _fuses(module, tap, x, module.weight.shape[1 if transposed else 0]):
        holder = WeightGrad()
        out = _FusedLinear.apply(x, module.weight, module.bias, holder, transposed)
        out._gradlens_weight_grad = holder
        return out
    return type(module).forward(module, x)


_FUSED_TRANSPOSED = functools.partial(_fused_forward, transposed=True)


def fused_forward_for(module: nn.Module, kernel: Kernel, fuse: frozenset) -> Callable | None:
    """The fused tracked-window forward of ``module`` (:func:`_fused_forward`), or None: its
    class is one its kernel lets run fused (:attr:`gradlens.kernels.base.Kernel.fused_layers`,
    which also says whether the weight is transposed) and one the Meter's plan fuses (``fuse``,
    qualified class names: :attr:`gradlens.capture.tap.Tap.fuse_weight_grad`)."""
    name = qualname(type(module))
    transposed = kernel.fused_layers.get(name)
    if transposed is None or name not in fuse:
        return None
    return _FUSED_TRANSPOSED if transposed else _fused_forward


def _stacks(module: nn.Module, tap: "Tap", x: Tensor, d_out: int) -> bool:
    """Whether the Meter may stack this Linear-like call by its size (``tap.stacks_if``): it is
    small enough to be measured with others like it at the window's end, which beats fusing."""
    rows = x.numel() // max(x.shape[-1], 1)
    numel = module.weight.numel() + (module.bias.numel() if module.bias is not None else 0)
    return tap.stacks_if(x.numel() + rows * d_out, tap._batch or x.shape[0], numel)


def _elementwise_forward(module: nn.Module, tap: "Tap", *args, **kwargs):
    """The forward of a parameter-free elementwise module (:func:`gradlens.capture.registry.elementwise`:
    dropout, activations) during tracked windows, instead of the Tap's module hooks: its own
    forward, run with the mode off the torch-function stack when the mode is the innermost one
    (back on after it, also on an exception); its output then takes the marks that following
    its operations one by one gives (:meth:`gradlens.capture.tap.Tap._unary`). Called on its own (not inside the
    model's forward), it opens and closes the tracked forward, as the hooks of any other
    submodule do. The module's own hooks run as usual, with the mode on."""
    if not tap._mode_depth and torch.is_grad_enabled() and not compat.in_functorch_transform():
        tap._root_pre(module, args, kwargs)  # called on its own: a root
        out = None
        try:
            out = _elementwise_forward(module, tap, *args, **kwargs)
            return out
        finally:
            tap._root_post(module, args, out)
    fwd = type(module).forward
    if (kwargs or len(args) != 1 or not isinstance(args[0], Tensor) or not tap._mode_depth or tap._skip
            or tap._mode_out or compat.top_function_mode() is not tap._mode):
        return fwd(module, *args, **kwargs)
    x = args[0]
    tap._mode.__exit__(None, None, None)
    tap._mode_out = True
    try:
        out = fwd(module, x)
        tap._unary(x, out)  # (with the mode off: its metadata reads are not calls of the forward)
    finally:
        if tap._mode_out:  # (unless the Tap was removed meanwhile)
            tap._mode_out = False
            tap._mode.__enter__()
    return out
