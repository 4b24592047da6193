"""Accumulation-aware BatchNorm: :class:`AccumBatchNorm1d` / ``2d`` / ``3d`` and
:func:`convert_accum_batchnorm`.

In training, the forward normalises with the **micro-batch** statistics, exactly like
``nn.BatchNorm``. No single-pass method can normalise a micro-batch with statistics of the whole
window: those depend on micro-batches whose forward has not run yet. What *can* be made exact is
the running statistics: each training forward folds the micro-batch's per-channel count, mean
and biased variance into the window's pooled statistics (Chan et al.'s parallel merge, which adds
the between-micro-batch term and has no cancellation), and once per window the running mean and
running variance are updated from the pooled mean and the **unbiased** pooled variance, with the
momentum applied once and ``num_batches_tracked`` incremented once. After a window of K
micro-batches the running statistics equal those of ``nn.BatchNorm`` run once on the
concatenated batch. (Averaging the micro-batch variances instead drops the between-micro-batch
term and underestimates the variance.)

**Windows from the optimizer (recommended).** :func:`follow_optimizer` (or
``convert_accum_batchnorm(model, optimizer=opt)``) registers the BatchNorms with a
:class:`~gradlens.GradientAccumulateOptimizer`: the running statistics are updated when the
optimizer really updates and dropped when it ends a window without an update (a GradScaler
inf/nan, ``opt.reset()``), so ``accum_steps`` is given once, to the optimizer, and a skipped
window never reaches the running statistics.

**Masks.** ``forward(input, mask)`` takes a mask like Keras' ``AccumBatchNormalization.call(inputs,
training, mask)``: ``mask`` is ``[B, *spatial]`` (e.g. ``[B, L]`` for ``[B, C, L]`` padded
sequences, ``[B]`` for ``[B, C]``), true at the positions that count. In training, the micro-batch
statistics and the window's pooled statistics use the unmasked positions only (every position of
the output is normalised with them); evaluation ignores the mask. A masked training forward reads
its valid count on the host (one sync).

Standalone, a window ends after ``accum_steps`` training-mode forwards (every training forward counts, also
under ``torch.no_grad()``), or when :meth:`flush` is called (a partial window, e.g. at the end of
an epoch: use :func:`flush_accum_batchnorm` on the model next to
``GradientAccumulateOptimizer.flush()``). Evaluation mode behaves exactly like ``nn.BatchNorm``
and ignores a window still open; ``track_running_stats=False`` behaves exactly like
``nn.BatchNorm`` too.

**Other BatchNorm layers.** :class:`AccumSyncBatchNorm` is ``nn.SyncBatchNorm``'s counterpart:
on one process (or without an initialised process group) it is an ``AccumBatchNorm``; where
its process group has several ranks, each training forward normalises with the statistics of
the micro-batch of all ranks (as ``nn.SyncBatchNorm`` does; reduced with ``all_reduce`` on any
backend, also gloo on CPU, with the statistics' gradient paths reduced in backward) and folds
those into the window, so that every rank holds the running statistics of one batch of all the
window's samples. :class:`AccumBatchNormAct2d` / :class:`AccumSyncBatchNormAct` keep a fused
``drop`` and ``act`` (timm's ``BatchNormAct2d`` / ``SyncBatchNormAct``: ``act(drop(bn(x)))``).
:func:`convert_accum_batchnorm` converts the exact classes in its table
(:func:`register_accum_batchnorm` adds one; timm's classes are added when ``timm`` is already
imported: gradlens never imports it).
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from gradlens.training.accum_checks import check_accum_steps
from gradlens import compat
from gradlens.compat import BatchNormBase as _BatchNorm
from gradlens.core.counter import WindowCounter
from gradlens.training.accum_optimizer import GradientAccumulateOptimizer

__all__ = [
    "AccumBatchNorm1d",
    "AccumBatchNorm2d",
    "AccumBatchNorm3d",
    "AccumBatchNormAct2d",
    "AccumSyncBatchNorm",
    "AccumSyncBatchNormAct",
    "convert_accum_batchnorm",
    "register_accum_batchnorm",
    "flush_accum_batchnorm",
    "follow_optimizer",
]

_WINDOW_BUFFERS = ("window_mean", "window_var", "window_count", "window_steps")


def _check_accum_steps(accum_steps: Any) -> int:
    return check_accum_steps(
        accum_steps,
        "training forwards per window",
        "use accum_steps=1 to update the running statistics on every forward like nn.BatchNorm",
    )


class _AccumBatchNormMixin:
    """The accumulation logic shared by the 1d/2d/3d classes (placed before ``_BatchNorm`` in the MRO).

    Buffers (besides ``nn.BatchNorm``'s own, with ``track_running_stats``):
        window_mean: ``[C]`` pooled mean of the open window, dtype of ``running_mean``.
        window_var: ``[C]`` pooled *biased* variance of the open window.
        window_count: ``[]`` int64, values per channel folded in so far (samples x spatial size).
        window_steps: ``[]`` int64, training forwards folded in so far.
    They are saved in the state dict; loading a plain ``nn.BatchNorm`` state dict (without them)
    starts an empty window. Their Python mirror (no device sync per forward) is the window's
    :class:`~gradlens.core.counter.WindowCounter`: micro-steps = training forwards, samples = values
    per channel.
    """

    accum_steps: int

    def __init__(
        self,
        num_features: int,
        accum_steps: int = 1,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        # the nn.BatchNorm{1,2,3}d that follows this mixin in the MRO
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self._init_window(accum_steps)

    def _init_window(self, accum_steps: int) -> None:
        self.accum_steps = _check_accum_steps(accum_steps)
        self.follows_optimizer = False  # set by follow_optimizer: windows end with the optimizer
        self._counter = WindowCounter()  # mirrors window_steps / window_count: no device sync per step
        if self.track_running_stats:
            rm = self.running_mean
            self.register_buffer("window_mean", torch.zeros_like(rm))
            self.register_buffer("window_var", torch.zeros_like(rm))
            self.register_buffer("window_count", torch.zeros((), dtype=torch.long, device=rm.device))
            self.register_buffer("window_steps", torch.zeros((), dtype=torch.long, device=rm.device))
            compat.register_load_state_dict_pre_hook(self, _fill_window_buffers)
            self.register_load_state_dict_post_hook(_sync_window_counter)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, accum_steps={self.accum_steps}"

    @property
    def window_open(self) -> bool:
        """Whether training forwards have been folded into a window not yet applied."""
        return self._counter.is_open

    def forward(self, input: Tensor, mask: Tensor | None = None) -> Tensor:
        """``[B, C, *spatial]`` -> same shape. Training: micro-batch statistics (over the
        positions where ``mask [B, *spatial]`` is true, if given); see the module doc."""
        if mask is not None and self.training:
            return self._masked_forward(input, mask)
        if not (self.training and self.track_running_stats):
            return super().forward(input)
        compat.batchnorm_check_input_dim(self, input)
        channels = input.shape[1]
        count = input.numel() // channels if channels else 0
        if count <= 1:
            raise ValueError(
                f"Expected more than 1 value per channel when training, got input size "
                f"{tuple(input.shape)}; use a micro-batch with more than one value per channel."
            )
        # momentum=1 makes batch_norm write the micro-batch mean and unbiased variance into these
        # scratch buffers, taken from the same fused pass that normalises the input.
        batch_mean = torch.zeros_like(self.running_mean)
        batch_var = torch.ones_like(self.running_var)
        out = F.batch_norm(
            input, batch_mean, batch_var, self.weight, self.bias, True, 1.0, self.eps
        )
        self._fold(batch_mean, batch_var, count)
        if self._counter.micro_steps >= self.accum_steps and not self.follows_optimizer:
            self.flush()
        return out

    def _check_mask(self, input: Tensor, mask: Tensor) -> None:
        spatial = (input.shape[0], *input.shape[2:])
        if not isinstance(mask, Tensor) or tuple(mask.shape) != spatial:
            got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
            raise ValueError(
                f"mask must be a tensor of shape {spatial} ([B, *spatial] of the input "
                f"{tuple(input.shape)}: true where a position counts), got {got}"
            )

    def _masked_forward(self, input: Tensor, mask: Tensor) -> Tensor:
        compat.batchnorm_check_input_dim(self, input)
        self._check_mask(input, mask)
        m = mask.to(dtype=input.dtype).unsqueeze(1)  # [B, 1, *spatial]
        dims = [0] + list(range(2, input.dim()))
        count = int(mask.sum())  # one sync: the pooled statistics need the count
        if count <= 1:
            raise ValueError(
                f"the mask leaves {count} position(s) per channel; training statistics need more "
                "than 1 (skip the forward of a micro-batch that is all padding)"
            )
        shape = [1, -1] + [1] * (input.dim() - 2)
        mean = (input * m).sum(dims) / count
        centred = input - mean.view(shape)
        var = (centred.square() * m).sum(dims) / count  # biased, as nn.BatchNorm normalises
        return self._normalise(centred, mean, var, count, shape)

    def _normalise(self, centred: Tensor, mean: Tensor, var: Tensor, count: int, shape: list[int]) -> Tensor:
        """The training output from the micro-batch's centred input and biased ``var``
        (``[C]``), the affine map applied; the statistics folded into the window (and the
        window flushed when it is complete)."""
        out = centred * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats:
            self._fold(mean.detach(), var.detach() * (count / (count - 1)), count)
            if self._counter.micro_steps >= self.accum_steps and not self.follows_optimizer:
                self.flush()
        return out

    @torch.no_grad()
    def _fold(self, batch_mean: Tensor, batch_var_unbiased: Tensor, count: int) -> None:
        """Merge one micro-batch (``[C]`` mean, ``[C]`` unbiased variance, count) into the window."""
        work = torch.float64 if batch_mean.device.type != "mps" else torch.float32
        mean_b = batch_mean.to(work)
        var_b = batch_var_unbiased.to(work) * ((count - 1) / count)  # biased
        n_a = int(self._counter.samples)  # values per channel so far (exact: integers below 2**53)
        if n_a == 0:
            self.window_mean.copy_(mean_b)
            self.window_var.copy_(var_b)
        else:
            n = n_a + count
            mean_a = self.window_mean.to(work)
            var_a = self.window_var.to(work)
            delta = mean_b - mean_a
            self.window_mean.copy_(mean_a + delta * (count / n))
            self.window_var.copy_(
                var_a * (n_a / n) + var_b * (count / n) + delta.square() * (n_a * count / n / n)
            )
        self._counter.note_micro(count)
        self.window_count.fill_(n_a + count)
        self.window_steps.fill_(self._counter.micro_steps)

    @torch.no_grad()
    def flush(self) -> bool:
        """Close the open window: update the running statistics once from its pooled values.

        ``running_mean <- (1 - m) running_mean + m * mean`` and ``running_var <- (1 - m)
        running_var + m * var * n / (n - 1)`` with n the pooled count and m the momentum (or
        ``1 / num_batches_tracked`` when momentum is None); ``num_batches_tracked += 1``.

        Returns:
            Whether a window was open (and applied).
        """
        if not self.track_running_stats or not self._counter.is_open:
            return False
        n = int(self._counter.samples)
        work = torch.float64 if self.running_mean.device.type != "mps" else torch.float32
        mean = self.window_mean.to(work)
        var = self.window_var.to(work) * (n / (n - 1))
        self.num_batches_tracked.add_(1)
        if self.momentum is None:
            factor: Tensor | float = 1.0 / self.num_batches_tracked.to(work)
        else:
            factor = float(self.momentum)
        self.running_mean.copy_(self.running_mean.to(work) * (1 - factor) + mean * factor)
        self.running_var.copy_(self.running_var.to(work) * (1 - factor) + var * factor)
        self.reset_window()
        return True

    @torch.no_grad()
    def reset_window(self) -> None:
        """Drop the open window without touching the running statistics."""
        self._counter.reset()
        if self.track_running_stats:
            self.window_mean.zero_()
            self.window_var.zero_()
            self.window_count.zero_()
            self.window_steps.zero_()



def _fill_window_buffers(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                         error_msgs) -> None:
    """Load pre-hook of an AccumBatchNorm: a plain ``nn.BatchNorm`` state dict (no window
    buffers) loads with an empty window."""
    present = [prefix + name in state_dict for name in _WINDOW_BUFFERS]
    if module.track_running_stats and not any(present):
        module.reset_window()
        for name in _WINDOW_BUFFERS:
            state_dict[prefix + name] = getattr(module, name).clone()


def _sync_window_counter(module, incompatible_keys) -> None:
    """Load post-hook of an AccumBatchNorm: the counters mirror the loaded window buffers."""
    if module.track_running_stats:
        module._counter.micro_steps = int(module.window_steps)
        module._counter.samples = float(int(module.window_count))


class AccumBatchNorm1d(_AccumBatchNormMixin, nn.BatchNorm1d):
    """``nn.BatchNorm1d`` (input ``[B, C]`` or ``[B, C, L]``) whose running statistics are
    updated once per window of ``accum_steps`` training forwards, from the pooled window.

    Args:
        num_features: C.
        accum_steps: training forwards per window (match the optimizer's ``accum_steps``).
        eps, momentum, affine, track_running_stats, device, dtype: as in ``nn.BatchNorm1d``.
    """


class AccumBatchNorm2d(_AccumBatchNormMixin, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` (input ``[B, C, H, W]``) whose running statistics are updated once per
    window of ``accum_steps`` training forwards, from the pooled window.

    Args:
        num_features: C.
        accum_steps: training forwards per window (match the optimizer's ``accum_steps``).
        eps, momentum, affine, track_running_stats, device, dtype: as in ``nn.BatchNorm2d``.
    """


class AccumBatchNorm3d(_AccumBatchNormMixin, nn.BatchNorm3d):
    """``nn.BatchNorm3d`` (input ``[B, C, D, H, W]``) whose running statistics are updated once
    per window of ``accum_steps`` training forwards, from the pooled window.

    Args:
        num_features: C.
        accum_steps: training forwards per window (match the optimizer's ``accum_steps``).
        eps, momentum, affine, track_running_stats, device, dtype: as in ``nn.BatchNorm3d``.
    """


class _ActDropMixin:
    """``act(drop(norm(x)))``: a fused dropout and activation after the normalisation (timm's
    ``BatchNormAct2d`` layout; ``nn.Identity`` where none is given)."""

    def _init_act(self, act: nn.Module | None, drop: nn.Module | None) -> None:
        self.drop = drop if drop is not None else nn.Identity()
        self.act = act if act is not None else nn.Identity()

    def forward(self, input: Tensor, mask: Tensor | None = None) -> Tensor:
        return self.act(self.drop(super().forward(input, mask)))


class AccumBatchNormAct2d(_ActDropMixin, AccumBatchNorm2d):
    """:class:`AccumBatchNorm2d` followed by ``drop`` then ``act`` (what
    ``convert_accum_batchnorm`` makes of timm's ``BatchNormAct2d``; its modules are kept).

    Args:
        num_features, accum_steps, eps, momentum, affine, track_running_stats, device, dtype:
            as in :class:`AccumBatchNorm2d`.
        act: the activation module (default ``nn.Identity()``).
        drop: the dropout module applied before it (default ``nn.Identity()``).
    """

    def __init__(self, num_features: int, accum_steps: int = 1, *args: Any, act: nn.Module | None = None,
                 drop: nn.Module | None = None, **kwargs: Any) -> None:
        super().__init__(num_features, accum_steps, *args, **kwargs)
        self._init_act(act, drop)


class _AllReduceSum(torch.autograd.Function):
    """``all_reduce(SUM)`` of a tensor over ``group`` whose backward all-reduces the gradient:
    every rank's loss reaches every rank's input through the pooled statistics."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, group: Any) -> Tensor:
        ctx.group = group
        t = t.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(t, group=group)
        return t

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class AccumSyncBatchNorm(_AccumBatchNormMixin, nn.SyncBatchNorm):
    """``nn.SyncBatchNorm`` (input ``[B, C, *spatial]``) whose running statistics are updated
    once per window from the pooled statistics of every rank's micro-batches.

    On one rank (no process group initialised, or a group of one) it is exactly an
    ``AccumBatchNorm``, as ``nn.SyncBatchNorm`` is a ``BatchNorm`` there. With several ranks a
    training forward normalises with the biased variance and mean of the micro-batch of all
    ranks (``all_reduce`` of the per-channel count, sum and centred sum of squares: one host
    sync for the count; gradients flow through the pooled statistics to every rank, as in
    ``nn.SyncBatchNorm``), and folds those statistics into the window: after a window every rank
    holds the running statistics of ``nn.BatchNorm`` run once on the window's samples of all
    ranks. Unlike ``nn.SyncBatchNorm`` it runs on CPU tensors too (gloo). Every rank must run
    the same number of training forwards per window. (A :class:`~gradlens.Lens` refuses such a
    multi-rank training forward as a place where the sample axis is lost, for this layer and
    every layer after it; in eval mode, or on one rank, it is measured as ``AccumBatchNorm`` is.)

    Args:
        num_features, accum_steps, eps, momentum, affine, track_running_stats, device, dtype:
            as in :class:`AccumBatchNorm2d`.
        process_group: the ranks whose statistics are pooled (default: the world).
    """

    def __init__(self, num_features: int, accum_steps: int = 1, eps: float = 1e-5,
                 momentum: float | None = 0.1, affine: bool = True, track_running_stats: bool = True,
                 process_group: Any = None, device: Any = None, dtype: Any = None) -> None:
        nn.SyncBatchNorm.__init__(self, num_features, eps, momentum, affine, track_running_stats, process_group,
                                  device, dtype)
        self._init_window(accum_steps)

    def _sync_group(self) -> Any:
        """The process group to pool over, or None where this is one rank."""
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return None
        group = self.process_group or dist.group.WORLD
        return group if dist.get_world_size(group) > 1 else None

    def forward(self, input: Tensor, mask: Tensor | None = None) -> Tensor:
        """``[B, C, *spatial]`` -> same shape; see the class doc."""
        group = self._sync_group()
        if group is None:
            return super().forward(input, mask)
        compat.batchnorm_check_input_dim(self, input)
        channels = input.shape[1]
        dims = [0] + list(range(2, input.dim()))
        shape = [1, -1] + [1] * (input.dim() - 2)
        m = None
        if mask is not None:
            self._check_mask(input, mask)
            m = mask.to(dtype=input.dtype).unsqueeze(1)  # [B, 1, *spatial]
            local = mask.sum().to(torch.long)
        else:
            local = torch.tensor(input.numel() // channels if channels else 0, device=input.device)
        dist.all_reduce(local, group=group)
        count = int(local)  # one sync: the pooled statistics need the count
        if count <= 1:
            raise ValueError(
                f"the micro-batch of all ranks has {count} value(s) per channel (input size "
                f"{tuple(input.shape)} here); training statistics need more than 1"
            )
        total = (input if m is None else input * m).sum(dims)
        mean = _AllReduceSum.apply(total, group) / count
        centred = input - mean.view(shape)
        sq = centred.square() if m is None else centred.square() * m
        var = _AllReduceSum.apply(sq.sum(dims), group) / count  # biased, as nn.BatchNorm normalises
        return self._normalise(centred, mean, var, count, shape)


class AccumSyncBatchNormAct(_ActDropMixin, AccumSyncBatchNorm):
    """:class:`AccumSyncBatchNorm` followed by ``drop`` then ``act`` (timm's
    ``SyncBatchNormAct``); ``act`` and ``drop`` as in :class:`AccumBatchNormAct2d`."""

    def __init__(self, num_features: int, accum_steps: int = 1, *args: Any, act: nn.Module | None = None,
                 drop: nn.Module | None = None, **kwargs: Any) -> None:
        super().__init__(num_features, accum_steps, *args, **kwargs)
        self._init_act(act, drop)


Converter = Callable[[nn.Module, int], nn.Module]


def _rebuild(bn: _BatchNorm, target: type, accum_steps: int, **extra: Any) -> nn.Module:
    """``target(...)`` with ``bn``'s settings, sharing its Parameter and buffer objects: an
    optimizer built before conversion keeps working, and outputs are bit-identical."""
    ref = bn.running_mean if bn.track_running_stats else bn.weight
    new = target(
        bn.num_features,
        accum_steps,
        bn.eps,
        bn.momentum,
        bn.affine,
        bn.track_running_stats,
        device=None if ref is None else ref.device,
        dtype=None if ref is None else ref.dtype,
        **extra,
    )
    if bn.affine:
        new.weight = bn.weight
        new.bias = bn.bias
    if bn.track_running_stats:
        new.running_mean = bn.running_mean
        new.running_var = bn.running_var
        new.num_batches_tracked = bn.num_batches_tracked
    new.train(bn.training)
    return new


def _fused(bn: nn.Module) -> dict[str, Any]:
    """The fused modules of a BatchNorm-with-activation (kept, not copied)."""
    return {"act": getattr(bn, "act", None), "drop": getattr(bn, "drop", None)}


#: exact source class -> ``convert(bn, accum_steps) -> module`` (:func:`register_accum_batchnorm`)
_CONVERSIONS: dict[type, Converter] = {
    nn.BatchNorm1d: lambda bn, k: _rebuild(bn, AccumBatchNorm1d, k),
    nn.BatchNorm2d: lambda bn, k: _rebuild(bn, AccumBatchNorm2d, k),
    nn.BatchNorm3d: lambda bn, k: _rebuild(bn, AccumBatchNorm3d, k),
    nn.SyncBatchNorm: lambda bn, k: _rebuild(bn, AccumSyncBatchNorm, k, process_group=bn.process_group),
}

#: classes of libraries gradlens never imports, converted once the library is imported: (the
#: module that defines them, its attribute, the converter)
_LIBRARY_CONVERSIONS: tuple[tuple[str, str, Converter], ...] = (
    ("timm.layers.norm_act", "BatchNormAct2d",
     lambda bn, k: _rebuild(bn, AccumBatchNormAct2d, k, **_fused(bn))),
    ("timm.layers.norm_act", "SyncBatchNormAct",
     lambda bn, k: _rebuild(bn, AccumSyncBatchNormAct, k, process_group=bn.process_group, **_fused(bn))),
)


def register_accum_batchnorm(source: type, convert: Converter) -> None:
    """Let :func:`convert_accum_batchnorm` convert modules of exactly the class ``source``.

    Args:
        source: a ``BatchNorm`` class (a subclass of ``torch.nn.modules.batchnorm._BatchNorm``);
            its subclasses are not matched (their forward may compute something else).
        convert: ``convert(bn, accum_steps) -> module``: the accumulation-aware replacement of
            ``bn`` (typically an ``AccumBatchNorm`` subclass sharing ``bn``'s parameters and
            buffers, whose forward does what ``source``'s does). It replaces ``source``'s entry
            if there was one.
    """
    if not (isinstance(source, type) and issubclass(source, _BatchNorm)):
        raise TypeError(f"register_accum_batchnorm(source=...) takes a BatchNorm class, got {source!r}")
    if not callable(convert):
        raise TypeError(f"register_accum_batchnorm(convert=...) takes a callable (bn, accum_steps), got {convert!r}")
    _CONVERSIONS[source] = convert


def _converter(cls: type) -> Converter | None:
    got = _CONVERSIONS.get(cls)
    if got is not None:
        return got
    for module_name, attr, convert in _LIBRARY_CONVERSIONS:
        lib = sys.modules.get(module_name)  # only a library that is already imported
        if lib is not None and getattr(lib, attr, None) is cls:
            _CONVERSIONS.setdefault(cls, convert)
            return convert
    return None


def _convert_one(bn: _BatchNorm, accum_steps: int) -> nn.Module:
    if isinstance(bn, _AccumBatchNormMixin):
        if bn.window_open:
            raise RuntimeError(
                "cannot change accum_steps of an AccumBatchNorm with an open window; call "
                "flush() or reset_window() first."
            )
        bn.accum_steps = accum_steps
        return bn
    convert = _converter(type(bn))
    if convert is None:
        raise TypeError(
            f"cannot convert {type(bn).__module__}.{type(bn).__qualname__}: convert_accum_batchnorm converts "
            "nn.BatchNorm1d/2d/3d, nn.SyncBatchNorm and timm's BatchNormAct2d / SyncBatchNormAct (other "
            "BatchNorm subclasses would silently keep per-micro-batch running statistics); register its "
            "accumulation-aware replacement with gradlens.training.batchnorm.register_accum_batchnorm("
            f"{type(bn).__qualname__}, convert) or replace it by hand."
        )
    new = convert(bn, accum_steps)
    if not isinstance(new, nn.Module):
        raise TypeError(f"the converter registered for {type(bn).__qualname__} returned {type(new).__name__}, not a module")
    return new


def follow_optimizer(module: nn.Module, optimizer: Any) -> Any:
    """Let every ``AccumBatchNorm`` in ``module`` take its windows from ``optimizer``.

    ``optimizer`` is a :class:`~gradlens.GradientAccumulateOptimizer`: when it ends a window
    with a real update the BatchNorms apply their pooled statistics (:meth:`flush`), when it
    ends one without (GradScaler inf/nan, ``reset()``) they drop it (``reset_window``). Their
    own ``accum_steps`` is then not used. Returns the hook's handle (``.remove()`` detaches).

    Raises:
        TypeError: ``optimizer`` has no ``register_window_end_hook`` (a plain ``torch.optim``
            optimizer: wrap it in ``GradientAccumulateOptimizer``, or call
            :func:`flush_accum_batchnorm` after each ``step()`` yourself).
        ValueError: ``module`` has no AccumBatchNorm.
    """
    if not isinstance(optimizer, GradientAccumulateOptimizer):
        raise TypeError(
            f"follow_optimizer needs a GradientAccumulateOptimizer (it reports every window end, "
            f"also skipped ones), got {type(optimizer).__name__}; wrap it: "
            "GradientAccumulateOptimizer(opt, accum_steps=K)"
        )
    layers = [m for m in module.modules() if isinstance(m, _AccumBatchNormMixin)]
    if not layers:
        raise ValueError(
            "the module has no AccumBatchNorm layer; convert it first: "
            "convert_accum_batchnorm(model, optimizer=opt)"
        )
    for m in layers:
        m.follows_optimizer = True

    def on_window_end(opt: Any, updated: bool) -> None:
        for m in layers:
            if updated:
                m.flush()
            else:
                m.reset_window()

    return optimizer.register_window_end_hook(on_window_end)


def convert_accum_batchnorm(
    module: nn.Module, accum_steps: int | None = None, *, optimizer: Any = None
) -> nn.Module:
    """Replace every ``nn.BatchNorm1d/2d/3d`` in ``module`` by its ``AccumBatchNorm`` counterpart,
    ``nn.SyncBatchNorm`` by :class:`AccumSyncBatchNorm`, timm's ``BatchNormAct2d`` /
    ``SyncBatchNormAct`` by :class:`AccumBatchNormAct2d` / :class:`AccumSyncBatchNormAct` (their
    ``act`` and ``drop`` modules kept), and classes added by :func:`register_accum_batchnorm`.

    With ``optimizer=`` (a :class:`~gradlens.GradientAccumulateOptimizer`) the layers take
    their windows from it (:func:`follow_optimizer`) and ``accum_steps`` is read from it
    (give it once, to the optimizer).

    Weight, bias, running statistics, ``num_batches_tracked``, eps, momentum and the training
    flag are kept (the same tensors are reused). Existing ``AccumBatchNorm`` modules get the new
    ``accum_steps``. Children are replaced in place; the (possibly new) root is returned, so use
    ``model = convert_accum_batchnorm(model, k)``. Module hooks on replaced layers are not copied.

    Raises:
        TypeError: for other ``_BatchNorm`` subclasses (the message names
            :func:`register_accum_batchnorm`).
    """
    if optimizer is not None:
        opt_steps = optimizer.accum_steps if isinstance(optimizer, GradientAccumulateOptimizer) else None
        if accum_steps is not None and accum_steps != opt_steps:
            raise ValueError(
                f"accum_steps={accum_steps!r} but the optimizer has accum_steps={opt_steps!r}; "
                "give accum_steps once, to the optimizer (convert_accum_batchnorm(model, optimizer=opt))"
            )
        if not isinstance(optimizer, GradientAccumulateOptimizer):
            follow_optimizer(module, optimizer)  # raises the TypeError that names the fix
        converted = convert_accum_batchnorm(module, opt_steps)
        follow_optimizer(converted, optimizer)
        return converted
    if accum_steps is None:
        raise TypeError(
            "convert_accum_batchnorm needs accum_steps=K or optimizer=GradientAccumulateOptimizer(...)"
        )
    accum_steps = _check_accum_steps(accum_steps)
    if isinstance(module, _BatchNorm):
        return _convert_one(module, accum_steps)
    for name, child in module.named_children():
        converted = convert_accum_batchnorm(child, accum_steps)
        if converted is not child:
            setattr(module, name, converted)
    return module


def flush_accum_batchnorm(module: nn.Module) -> int:
    """Call :meth:`flush` on every ``AccumBatchNorm`` in ``module``; returns how many flushed."""
    return sum(int(m.flush()) for m in module.modules() if isinstance(m, _AccumBatchNormMixin))
