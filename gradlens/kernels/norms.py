"""Kernels of normalisation layers with an elementwise affine map ``y = x_hat * weight + bias``:
LayerNorm, RMSNorm, GroupNorm, InstanceNorm, BatchNorm with batch statistics (which mixes
samples) and BatchNorm in eval mode (an affine map of the running statistics, ``kind = "bn"``).
g_n is as small as one sample's normalised features (``[B, C]``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradlens.kernels.base import Kernel, add_into, joint_sq_norm

__all__ = ["LayerNormKernel", "RMSNormKernel", "GroupNormKernel", "InstanceNormKernel",
           "BatchNormBatchStatsKernel", "BatchNormEvalKernel"]


class _NormKernel(Kernel):
    """Normalisation layers with an elementwise affine map ``y = x_hat * weight + bias``:
    g_n(weight) = sum over the non-parameter axes of ``delta_n * x_hat_n``, g_n(bias) = sum of
    ``delta_n``. ``x_hat`` is recomputed from the layer input (subclasses define it and where the
    parameter axes are). The per-sample gradients are as small as one sample's normalised
    features (``[B, C]``): the sums and norms come from them in one call (``factored``: no
    materialising pass over chunks of samples)."""

    factored = True

    def reduce(self, module, a, delta, want, names, acc, skip=()):
        g = self.per_sample(module, a, delta, 0, delta.shape[0], attrs=list(names))
        for q in ("sum_grad_squared", "grad_sum"):
            if q in want:
                for attr, key in names.items():
                    if (q, attr) not in skip:
                        add_into(acc[q], key, g[attr].square().sum(0) if q == "sum_grad_squared" else g[attr].sum(0))
        if "batch_l2" not in want:
            return []
        return [joint_sq_norm(g, names)]

    def stacked_reduce(self, module, a, delta, k, groups, sums, acc):
        # one per-sample pass (as small as the normalised features) for the norms and the sums
        return self._stacked_materialised(module, a, delta, k, groups, sums)

    def batch_l2(self, module, a, delta):
        return {attr: g.reshape(g.shape[0], -1).square().sum(1) for attr, g in self.per_sample(module, a, delta, 0, delta.shape[0]).items()}

    def sum_grad_squared(self, module, a, delta):
        return {attr: g.square().sum(0) for attr, g in self.per_sample(module, a, delta, 0, delta.shape[0]).items()}

    def grad_sum(self, module, a, delta):
        return {attr: g.sum(0) for attr, g in self.per_sample(module, a, delta, 0, delta.shape[0]).items()}

    def x_hat(self, module, a: Tensor) -> Tensor:
        raise NotImplementedError

    def param_dims(self, module, x: Tensor) -> tuple[int, ...]:
        """Axes of the batch-first input ``x`` that the parameter spans."""
        raise NotImplementedError

    def _sum_to_param(self, module, x: Tensor, t: Tensor) -> Tensor:
        keep = set(self.param_dims(module, x)) | {0}
        dims = tuple(d for d in range(1, t.dim()) if d not in keep)
        return t.sum(dims) if dims else t

    def per_sample(self, module, a, delta, start, stop, attrs=None):
        attrs = self.params(module) if attrs is None else attrs
        x, d = a[start:stop], delta[start:stop]
        out = {}
        if "weight" in attrs:
            out["weight"] = self._sum_to_param(module, x, d * self.x_hat(module, a)[start:stop])
        if "bias" in attrs:
            out["bias"] = self._sum_to_param(module, x, d)
        return out


class LayerNormKernel(_NormKernel):
    """``nn.LayerNorm``: statistics of each sample (and position) over ``normalized_shape``."""

    rows_per_sample = True  # the statistics are per row: a sample's rows are more positions

    def routes_param_grads(self, module):
        return type(module) is nn.LayerNorm  # one F.layer_norm of the input and the parameters

    def param_dims(self, module, x):
        k = len(module.normalized_shape)
        return tuple(range(x.dim() - k, x.dim()))

    def x_hat(self, module, a):
        # the layer's own normalisation without its affine map (one fused pass; several times
        # faster on the CPU than var_mean and three elementwise passes)
        return F.layer_norm(a, module.normalized_shape, None, None, module.eps)

    def stack_key(self, module, attrs):
        return (tuple(module.normalized_shape), module.eps)


class RMSNormKernel(LayerNormKernel):
    """``nn.RMSNorm``: ``x * rsqrt(mean(x^2) + eps)`` over ``normalized_shape``."""

    def x_hat(self, module, a):
        dims = self.param_dims(module, a)
        eps = module.eps if module.eps is not None else torch.finfo(a.dtype).eps
        return a * torch.rsqrt(a.square().mean(dims, keepdim=True) + eps)


class _ChannelNormKernel(_NormKernel):
    """Norms with a per-channel affine map on ``[B, C, *spatial]`` (GroupNorm, InstanceNorm,
    BatchNorm with batch statistics)."""

    def param_dims(self, module, x):
        return (1,)


class GroupNormKernel(_ChannelNormKernel):
    """``nn.GroupNorm``: statistics of each sample over each group of channels."""

    def stack_key(self, module, attrs):
        return (module.num_groups, module.eps)

    def x_hat(self, module, a):
        b = a.shape[0]
        g = a.reshape(b, module.num_groups, -1)
        var, mean = torch.var_mean(g, dim=2, unbiased=False, keepdim=True)
        return ((g - mean) * torch.rsqrt(var + module.eps)).view_as(a)


class InstanceNormKernel(_ChannelNormKernel):
    """``nn.InstanceNorm{1,2,3}d(affine=True)``: statistics of each sample and channel (or the
    running statistics in eval mode with ``track_running_stats=True``)."""

    def x_hat(self, module, a):
        if not module.training and module.track_running_stats and module.running_mean is not None:
            return _running_x_hat(module, a)
        dims = tuple(range(2, a.dim()))
        var, mean = torch.var_mean(a, dim=dims, unbiased=False, keepdim=True)
        return (a - mean) * torch.rsqrt(var + module.eps)


class BatchNormBatchStatsKernel(_ChannelNormKernel):
    """``nn.BatchNorm{1,2,3}d`` normalising with the statistics of the micro-batch (training
    mode, or ``track_running_stats=False``). The batch statistics mix samples, which makes the
    per-sample gradients of everything *before* the layer undefined (the Lens refuses those);
    its own weight and bias, and the layers after it, stay exact."""

    mixes_samples = True
    per_micro_batch = True  # x_hat uses the statistics of its own micro-batch: never concatenate

    def x_hat(self, module, a):
        dims = (0,) + tuple(range(2, a.dim()))
        var, mean = torch.var_mean(a, dim=dims, unbiased=False, keepdim=True)
        return (a - mean) * torch.rsqrt(var + module.eps)


def _running_x_hat(module, a: Tensor) -> Tensor:
    shape = [1, -1] + [1] * (a.dim() - 2)
    mean = module.running_mean.view(shape).to(a.dtype)
    var = module.running_var.view(shape).to(a.dtype)
    return (a - mean) * torch.rsqrt(var + module.eps)


class BatchNormEvalKernel(Kernel):
    """``nn.BatchNorm{1,2,3}d`` in eval mode: a per-channel affine map of the running statistics.

    Each row is normalised on its own, so a sample may hold several rows of the input (a
    ``[B * N, C]`` flattening with the samples the leading factor, LeViT's
    ``bn(x.flatten(0, 1))``): they come last, ``a [B, C, *spatial, N]``, and are summed as
    positions."""

    kind = "bn"
    rows_per_sample = True
    rows_last = True  # channel-first: a sample's rows are one more trailing position

    def per_sample(self, module, a, delta, start, stop, attrs=None):
        x, d = a[start:stop], delta[start:stop]
        shape = [1, -1] + [1] * (x.dim() - 2)
        x_hat = (x - module.running_mean.view(shape)) / torch.sqrt(
            module.running_var.view(shape) + module.eps
        )
        dims = tuple(range(2, x.dim()))
        out = {
            "weight": (d * x_hat).sum(dims) if dims else d * x_hat,
            "bias": d.sum(dims) if dims else d,
        }
        return {n: out[n] for n in self.params(module)}

    def directional(self, module, a, delta, direction, attrs):
        """The affine map of the running statistics along D."""
        dt = delta.dtype
        D = {key: v.to(dt) for key, v in direction.items()}
        out = delta.new_zeros(delta.shape[0])
        shape = [1, -1] + [1] * (a.dim() - 2)
        dims = tuple(range(2, a.dim()))
        if "weight" in D:
            x_hat = (a - module.running_mean.view(shape).to(dt)) / torch.sqrt(
                module.running_var.view(shape).to(dt) + module.eps
            )
            prod = delta * x_hat
            out = out + (prod.sum(dims) if dims else prod) @ D["weight"]
        if "bias" in D:
            out = out + (delta.sum(dims) if dims else delta) @ D["bias"]
        return out
