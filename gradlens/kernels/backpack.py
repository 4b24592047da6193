"""The BackPACK bridge: per-sample gradients of layers without a gradlens kernel (Conv1d/3d,
transposed and grouped convolutions) through BackPACK's derivatives (``param_mjp`` with
``sum_batch=False``). BackPACK is imported only when a layer needs it
(:func:`_backpack_kernels`); where it is wrong or fails (string padding, ``output_padding > 0``)
the registry hands out :class:`gradlens.kernels.conv.VmapConvKernel` instead.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from gradlens.kernels.base import Kernel
from gradlens.kernels.conv import _ConvMaths

__all__ = ["BackpackKernel", "BackpackConvKernel"]


class BackpackKernel(Kernel):
    """Any module with BackPACK derivatives: per-sample gradients through ``param_mjp``
    (transposed convolutions; :class:`BackpackConvKernel` for Conv1d/2d/3d)."""

    def __init__(self, derivatives):
        self.derivatives = derivatives

    def per_sample(self, module, a, delta, start, stop, attrs=None):
        idx = list(range(start, stop))
        module.input0 = a
        module.output = delta  # only its shape is read
        try:
            return {
                n: self.derivatives.param_mjp(
                    n, module, None, (delta,), delta[start:stop], sum_batch=False, subsampling=idx
                )
                for n in (self.params(module) if attrs is None else attrs)
            }
        finally:
            del module.input0, module.output


class BackpackConvKernel(_ConvMaths, BackpackKernel):
    """``nn.Conv{1,2,3}d`` through BackPACK's derivatives, with the convolution forms of the
    cross-micro-step maths (``kind = "conv"``)."""


def _backpack_kernels() -> dict[type, Callable[[], Kernel]]:
    from backpack.core.derivatives.conv1d import Conv1DDerivatives
    from backpack.core.derivatives.conv2d import Conv2DDerivatives
    from backpack.core.derivatives.conv3d import Conv3DDerivatives
    from backpack.core.derivatives.conv_transpose1d import ConvTranspose1DDerivatives
    from backpack.core.derivatives.conv_transpose2d import ConvTranspose2DDerivatives
    from backpack.core.derivatives.conv_transpose3d import ConvTranspose3DDerivatives

    return {
        nn.Conv1d: lambda: BackpackConvKernel(Conv1DDerivatives()),
        nn.Conv2d: lambda: BackpackConvKernel(Conv2DDerivatives()),
        nn.Conv3d: lambda: BackpackConvKernel(Conv3DDerivatives()),
        nn.ConvTranspose1d: lambda: BackpackKernel(ConvTranspose1DDerivatives()),
        nn.ConvTranspose2d: lambda: BackpackKernel(ConvTranspose2DDerivatives()),
        nn.ConvTranspose3d: lambda: BackpackKernel(ConvTranspose3DDerivatives()),
    }
