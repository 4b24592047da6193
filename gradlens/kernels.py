"""Per-layer kernels: per-sample gradient quantities from a layer's input and output gradient.

Every kernel has the same signature. It receives the module, its input ``a`` (as seen in the
forward pass, ``[B, ...]``) and ``delta``, the gradient of the *per-sample* losses with respect
to the module output (``[B, ...]``, already rescaled so that row n belongs to g_n, see
DESIGN.md), and returns a dict parameter attribute name (``"weight"``, ``"bias"``) -> value.

- ``per_sample(module, a, delta, start, stop)``: ``[stop - start, *param]``, g_n for a slice of
  samples (materialised; callers keep slices small).
- ``batch_l2(module, a, delta)``: ``[B]``, ||g_n||^2.
- ``sum_grad_squared(module, a, delta)``: ``[*param]``, sum_n g_n * g_n.
- ``grad_sum(module, a, delta)``: ``[*param]``, sum_n g_n.
- ``reduce(module, a, delta, want, names, acc)``: what the Lens calls: the wanted sums added
  into the window's accumulators in place (Linear: squares once, ``addmm_`` into reused
  buffers), and the ``[B]`` norms returned.
- ``outer_factors(module, a, delta)``: ``(delta [B, O], a [B, I])`` for weights whose g_n is a
  rank-one outer product (histograms use it to skip materialisation).

Linear layers use the factor identities of DESIGN.md (no ``[B, *param]`` tensor). Conv2d uses
unfold + bmm, Embedding a scatter of the output gradients; layers without a gradlens kernel
(Conv1d/3d, transposed and grouped convolutions) use BackPACK's derivatives (``param_mjp`` with
``sum_batch=False``), except where BackPACK is wrong or fails: string padding (``"same"``,
``"valid"``) and ``output_padding > 0`` go through :class:`VmapConvKernel` (``torch.func.vmap``
over samples of the one convolution's weight VJP: exact for every stride, dilation, group and
padding). Conv2d's unfold kernel takes string padding as explicit, possibly asymmetric, pads.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Kernel", "kernel_for", "SUPPORTED_MODULES"]


class Kernel:
    """Default kernel: everything derived from materialised per-sample gradients."""

    #: sample slice used when a reduction has to materialise; bounded by element count.
    max_chunk_elements = 1 << 22

    def params(self, module: nn.Module) -> list[str]:
        return [n for n, p in module.named_parameters(recurse=False) if p.requires_grad]

    def per_sample(self, module, a, delta, start: int, stop: int, attrs=None) -> dict[str, Tensor]:
        """``attrs``: only these parameters (default: all trainable); kernels may return more."""
        raise NotImplementedError

    def outer_factors(self, module, a, delta) -> dict[str, tuple[Tensor, Tensor]]:
        """Parameters whose per-sample gradient is the outer product ``delta_n a_n^T``:
        attribute -> (``delta [B, O]``, ``a [B, I]``). Empty for layers without that form."""
        return {}

    def _chunks(self, module, batch: int):
        numel = sum(p.numel() for p in module.parameters(recurse=False))
        step = max(1, self.max_chunk_elements // max(numel, 1))
        for s in range(0, batch, step):
            yield s, min(batch, s + step)

    def _reduce(self, module, a, delta, fn: Callable[[Tensor], Tensor], cat: bool) -> dict[str, Tensor]:
        parts: dict[str, list[Tensor]] = {}
        for s, e in self._chunks(module, delta.shape[0]):
            for name, g in self.per_sample(module, a, delta, s, e).items():
                parts.setdefault(name, []).append(fn(g))
        if cat:
            return {n: torch.cat(v) for n, v in parts.items()}
        return {n: torch.stack(v).sum(0) for n, v in parts.items()}

    def reduce(self, module, a, delta, want, names: dict[str, str], acc, skip=()) -> list[Tensor]:
        """Add this micro-step's sums into the window: for ``q`` in ``want`` among
        ``"sum_grad_squared"``/``"grad_sum"``, ``acc[q][names[attr]]`` += value (stored on first
        use); returns the ``[B]`` ||g_n||^2 parts of the tracked parameters if ``"batch_l2"``
        is wanted. Only parameters in ``names`` count; ``(quantity, attr)`` pairs in ``skip``
        are delivered by someone else (the weight gradient autograd computes anyway)."""
        for q in ("sum_grad_squared", "grad_sum"):
            if q in want:
                for attr, v in getattr(self, q)(module, a, delta).items():
                    if attr in names and (q, attr) not in skip:
                        add_into(acc[q], names[attr], v)
        if "batch_l2" not in want:
            return []
        return [v for attr, v in self.batch_l2(module, a, delta).items() if attr in names]

    def batch_l2(self, module, a, delta) -> dict[str, Tensor]:
        return self._reduce(module, a, delta, lambda g: g.flatten(1).square().sum(1), cat=True)

    def sum_grad_squared(self, module, a, delta) -> dict[str, Tensor]:
        return self._reduce(module, a, delta, lambda g: g.square().sum(0), cat=False)

    def grad_sum(self, module, a, delta) -> dict[str, Tensor]:
        return self._reduce(module, a, delta, lambda g: g.sum(0), cat=False)


def add_into(acc: dict[str, Tensor], key: str, v: Tensor) -> None:
    if key in acc:
        acc[key].add_(v)
    else:
        acc[key] = v


def _addmm_into(acc: dict[str, Tensor], key: str, m1: Tensor, m2: Tensor) -> None:
    """acc[key] += m1 @ m2. The first product of a window is written into the buffer the
    accumulator dict offers for ``key`` (``acc.buffer(key, shape, like)``, see
    :class:`gradlens.instruments.base.Accumulators`) so that large sums reuse memory across
    windows instead of faulting in fresh pages every step."""
    if key in acc:
        acc[key].addmm_(m1, m2)
        return
    buffer = getattr(acc, "buffer", None)
    out = buffer(key, (m1.shape[0], m2.shape[1]), m1) if buffer else None
    acc[key] = m1 @ m2 if out is None else torch.mm(m1, m2, out=out)


class LinearKernel(Kernel):
    """``nn.Linear`` with input ``[B, *, d_in]``; g_n = sum_t delta_nt a_nt^T."""

    factored = True

    @staticmethod
    def _flat(module, a, delta):
        b = delta.shape[0]
        return a.reshape(b, -1, a.shape[-1]), delta.reshape(b, -1, delta.shape[-1])

    def per_sample(self, module, a, delta, start, stop, attrs=None):
        attrs = self.params(module) if attrs is None else attrs
        out = {}
        if delta.dim() == 2:
            d, x = delta[start:stop], a[start:stop]
            if "weight" in attrs:
                out["weight"] = torch.einsum("no,ni->noi", d, x)
            if "bias" in attrs:
                out["bias"] = d
        else:
            x, d = self._flat(module, a[start:stop], delta[start:stop])
            if "weight" in attrs:
                out["weight"] = torch.bmm(d.transpose(1, 2), x)
            if "bias" in attrs:
                out["bias"] = d.sum(1)
        return out

    def outer_factors(self, module, a, delta):
        if delta.dim() != 2 or "weight" not in self.params(module):
            return {}
        if not (torch.isfinite(a).all() and torch.isfinite(delta).all()):
            return {}  # inf * 0 = nan: let the materialised path see what autograd would
        return {"weight": (delta, a)}

    def reduce(self, module, a, delta, want, names, acc, skip=()):
        if delta.dim() != 2:
            return super().reduce(module, a, delta, want, names, acc, skip)
        # one pass over the factors; the two weight sums are addmm's into the accumulators
        d2 = a2 = None
        if "sum_grad_squared" in want or "batch_l2" in want:
            scratch = getattr(acc["sum_grad_squared"], "scratch", lambda tag, like: None)
            d2 = torch.square(delta, out=scratch("d2", delta))
            a2 = torch.square(a, out=scratch("a2", a))
        w, b = names.get("weight"), names.get("bias")
        if "sum_grad_squared" in want:
            if w:
                _addmm_into(acc["sum_grad_squared"], w, d2.t(), a2)
            if b:
                add_into(acc["sum_grad_squared"], b, d2.sum(0))
        if "grad_sum" in want:
            if w and ("grad_sum", "weight") not in skip:
                _addmm_into(acc["grad_sum"], w, delta.t(), a)
            if b:
                add_into(acc["grad_sum"], b, delta.sum(0))
        if "batch_l2" not in want:
            return []
        d2n = d2.sum(1)
        out = []
        if w:
            out.append(d2n * a2.sum(1))
        if b:
            out.append(d2n)
        return out

    def _use_gram(self, module, t: int) -> bool:
        return 2 * t * t <= module.in_features * module.out_features

    def batch_l2(self, module, a, delta):
        if delta.dim() == 2:
            d2 = delta.square().sum(1)
            out = {"weight": d2 * a.square().sum(1), "bias": d2}
        else:
            x, d = self._flat(module, a, delta)
            if not self._use_gram(module, d.shape[1]):
                return super().batch_l2(module, a, delta)
            gram = torch.bmm(x, x.transpose(1, 2)) * torch.bmm(d, d.transpose(1, 2))
            out = {"weight": gram.sum((1, 2)), "bias": d.sum(1).square().sum(1)}
        return {n: out[n] for n in self.params(module)}

    def sum_grad_squared(self, module, a, delta):
        if delta.dim() != 2:
            return super().sum_grad_squared(module, a, delta)
        d2 = delta.square()
        out = {"weight": d2.t() @ a.square(), "bias": d2.sum(0)}
        return {n: out[n] for n in self.params(module)}

    def grad_sum(self, module, a, delta):
        x = a.reshape(-1, a.shape[-1])
        d = delta.reshape(-1, delta.shape[-1])
        out = {"weight": d.t() @ x, "bias": d.sum(0)}
        return {n: out[n] for n in self.params(module)}


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


class VmapConvKernel(Kernel):
    """Any ``nn.Conv{1,2,3}d`` / ``nn.ConvTranspose{1,2,3}d`` (every padding, stride, dilation,
    group, ``output_padding``): g_n of the weight is the VJP of this one convolution at sample
    n, for all samples at once with ``torch.func.vmap``; the bias gradient is delta summed over
    the spatial positions. ``[b, *param]`` per slice, in per-sample units."""

    def per_sample(self, module, a, delta, start, stop, attrs=None):
        from torch.func import vjp, vmap

        names = self.params(module) if attrs is None else attrs
        x, d = a[start:stop], delta[start:stop]
        out = {}
        if "weight" in names:
            transposed = isinstance(module, nn.modules.conv._ConvTransposeNd)
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


class Conv2dKernel(Kernel):
    """``nn.Conv2d`` (groups=1, zero padding): per-sample gradients via unfold + bmm."""

    def per_sample(self, module, a, delta, start, stop, attrs=None):
        a, padding = _explicit_padding(module, a)
        x = F.unfold(
            a[start:stop], module.kernel_size, module.dilation, padding, module.stride
        )  # [b, C_in*kh*kw, T]
        d = delta[start:stop].flatten(2)  # [b, C_out, T]
        out = {"weight": torch.bmm(d, x.transpose(1, 2)).view(-1, *module.weight.shape)}
        if module.bias is not None:
            out["bias"] = d.sum(2)
        return {n: out[n] for n in self.params(module)}

    def grad_sum(self, module, a, delta):
        d = delta
        out = {}
        names = self.params(module)
        if "weight" in names:
            a, padding = _explicit_padding(module, a)
            out["weight"] = torch.nn.grad.conv2d_weight(
                a, module.weight.shape, d, module.stride, padding, module.dilation
            )
        if "bias" in names:
            out["bias"] = d.sum((0, 2, 3))
        return out


class BatchNormEvalKernel(Kernel):
    """``nn.BatchNorm{1,2,3}d`` in eval mode: a per-channel affine map of the running statistics."""

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


class EmbeddingKernel(Kernel):
    """``nn.Embedding``: g_n of the table is the sum of delta_nt over the positions t whose
    index is v, row v (the ``padding_idx`` row gets no gradient, as in autograd)."""

    def _flat(self, module, a, delta):
        b = delta.shape[0]
        idx, d = a.reshape(b, -1), delta.reshape(b, -1, module.embedding_dim)
        if module.padding_idx is not None:
            d = d * (idx != module.padding_idx).unsqueeze(-1)
        return idx, d

    def per_sample(self, module, a, delta, start, stop, attrs=None):
        idx, d = self._flat(module, a[start:stop], delta[start:stop])
        out = d.new_zeros(idx.shape[0], module.num_embeddings, module.embedding_dim)
        out.scatter_add_(1, idx.unsqueeze(-1).expand_as(d), d)
        return {"weight": out}

    def batch_l2(self, module, a, delta):
        # ||g_n||^2 = sum_{t,t'} [idx_t = idx_t'] delta_t . delta_t' (no [V, D] per sample)
        idx, d = self._flat(module, a, delta)
        same = idx.unsqueeze(2) == idx.unsqueeze(1)
        return {"weight": (torch.bmm(d, d.transpose(1, 2)) * same).sum((1, 2))}

    def grad_sum(self, module, a, delta):
        idx, d = self._flat(module, a, delta)
        out = d.new_zeros(module.num_embeddings, module.embedding_dim)
        return {"weight": out.index_add_(0, idx.reshape(-1), d.reshape(-1, d.shape[-1]))}


class BackpackKernel(Kernel):
    """Any module with BackPACK derivatives: per-sample gradients through ``param_mjp``."""

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


def _backpack_kernels() -> dict[type, Callable[[], Kernel]]:
    from backpack.core.derivatives.conv1d import Conv1DDerivatives
    from backpack.core.derivatives.conv2d import Conv2DDerivatives
    from backpack.core.derivatives.conv3d import Conv3DDerivatives
    from backpack.core.derivatives.conv_transpose1d import ConvTranspose1DDerivatives
    from backpack.core.derivatives.conv_transpose2d import ConvTranspose2DDerivatives
    from backpack.core.derivatives.conv_transpose3d import ConvTranspose3DDerivatives

    return {
        nn.Conv1d: lambda: BackpackKernel(Conv1DDerivatives()),
        nn.Conv2d: lambda: BackpackKernel(Conv2DDerivatives()),
        nn.Conv3d: lambda: BackpackKernel(Conv3DDerivatives()),
        nn.ConvTranspose1d: lambda: BackpackKernel(ConvTranspose1DDerivatives()),
        nn.ConvTranspose2d: lambda: BackpackKernel(ConvTranspose2DDerivatives()),
        nn.ConvTranspose3d: lambda: BackpackKernel(ConvTranspose3DDerivatives()),
    }


SUPPORTED_MODULES: tuple[type, ...] = (
    nn.Linear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.Embedding,
    nn.modules.batchnorm._BatchNorm,
)


def kernel_for(module: nn.Module) -> Kernel:
    """The kernel for ``module``; raises ``TypeError`` for a module class without one.

    Subclasses are matched by their nearest supported base class, except that a module
    overriding ``forward`` of that base is refused (its per-sample gradients are unknown).
    """
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        if not module.track_running_stats or module.running_mean is None:
            raise ValueError(
                f"{type(module).__name__}(track_running_stats=False) normalises with batch "
                "statistics also in eval mode: it mixes the samples of a batch, so per-sample "
                "gradients of it and of every layer before it are undefined; use "
                "track_running_stats=True, or exclude it and the layers before it"
            )
        return BatchNormEvalKernel()
    base = next((c for c in type(module).__mro__ if c in SUPPORTED_MODULES), None)
    if base is None or type(module).forward is not base.forward:
        raise TypeError(f"no per-sample gradient kernel for {type(module).__name__}")
    if base is nn.Linear:
        return LinearKernel()
    if base is nn.Embedding:
        if module.scale_grad_by_freq:
            raise TypeError("nn.Embedding(scale_grad_by_freq=True) rescales by batch counts")
        return EmbeddingKernel()
    if base is nn.Conv2d and module.groups == 1:
        return Conv2dKernel()
    if isinstance(module.padding, str) or any(getattr(module, "output_padding", (0,))):
        return VmapConvKernel()  # BackPACK swaps roles of string padding, fails on output_padding
    return _backpack_kernels()[base]()
