"""Per-layer kernels: per-sample gradient quantities from a layer's input and output gradient.

Every kernel has the same signature. It receives the module, its input ``a`` (as seen in the
forward pass, ``[B, ...]``) and ``delta``, the gradient of the *per-sample* losses with respect
to the module output (``[B, ...]``, already rescaled so that row n belongs to g_n, see
docs/design.md), and returns a dict parameter attribute name (``"weight"``, ``"bias"``) -> value.

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
- ``add_per_sample(module, a, delta, attr, out)``: ``out [B, *param] += g_n`` (a shared
  parameter's later use; sequence Linear: one in-place ``baddbmm``).

Cross-micro-step maths (what BatchDot, InnerTest, OrthoTest and Alpha of
:mod:`gradlens.instruments.crosssample` ask of a layer; ``attrs`` is the iterable of tracked
parameter attributes, in order; ``D_l`` the number of their elements; the base class derives
everything from materialised slices, chunked by :func:`sample_chunks`):

- ``matrix_dims(module)``: ``(d_out, d_in)`` of the weight viewed as a matrix (Linear, ungrouped
  Conv), or None for layers without a rank-one factor form.
- ``positions(module, a, delta)``: T, the positions summed in g_n (sequence length, output
  pixels); 1 for a plain Linear and for layers without a factor form.
- ``seq_factors(module, a, delta, attrs)``: ``(X [B, T, d_in (+1)], Dl [B, T, d_out])`` with
  g_n = sum_t Dl_nt X_nt^T (a column of ones for the bias), or None.
- ``use_tgram(module, a, delta, n=None)``: whether the Gram of ``n`` samples is cheaper from
  ``T x T`` products of the factors than from materialised gradients (:func:`tgram_cheaper`;
  ``n=None``: for every window size, what a memory budget must assume).
- ``flat_per_sample(module, a, delta, start, stop, attrs)``: ``[stop - start, D_l]``.
- ``directional(module, a, delta, direction, attrs)``: ``[B]``, ``<D, g_n>`` for ``direction``
  attribute -> ``[*param]`` (Linear, Conv, eval BatchNorm: one forward of the layer along D).
- ``gram(module, pieces, attrs)``: ``[n, n]`` g_n . g_m for ``pieces`` = list of ``(a, delta)``
  (micro-steps, samples concatenated in order).
- ``gram_with_sum(module, a, delta, attrs)`` (Linear): one micro-step's Gram and, where it
  materialises weight row blocks, their sum over samples (a fused call's dL/dW, see
  :func:`gradlens.capture._fused_forward`).
- ``gram_materialises(module, a, delta)``: whether :meth:`Kernel.gram` forms ``[n, D_l]``.
- ``mean_via_gram(module, a, delta, n)``: whether ``g_n . G`` (G the mean of n samples) is
  cheaper as row sums of the Gram than through G.
- ``sketch(module, a, delta, attrs, k, pair)``: ``[B, k]``, ``R g_n`` for the Rademacher
  pairs ``pair(block, rows, cols) -> (u [k, rows] / sqrt(k), v [k, cols])`` (one block ``"wb"``
  ``[d_out, d_in + 1]`` for matrix layers, one per attribute otherwise).
- ``sketch_direction(module, direction, attrs, k, pair, like)``: ``[k]``, ``R D``.

Linear layers use the factor identities of docs/design.md (no ``[B, *param]`` tensor). Conv2d uses
unfold + bmm, Embedding a scatter of the output gradients; layers without a gradlens kernel
(Conv1d/3d, transposed and grouped convolutions) use BackPACK's derivatives (``param_mjp`` with
``sum_batch=False``), except where BackPACK is wrong or fails: string padding (``"same"``,
``"valid"``) and ``output_padding > 0`` go through :class:`VmapConvKernel` (``torch.func.vmap``
over samples of the one convolution's weight VJP: exact for every stride, dilation, group and
padding). Conv2d's unfold kernel takes string padding as explicit, possibly asymmetric, pads.

One chunking rule: whatever materialises per-sample slices takes ``b`` samples at a time with
``b * numel_per_sample <= budget`` (:func:`sample_chunks`, default budget
:data:`CHUNK_ELEMENTS`).
"""

from __future__ import annotations

from typing import Callable, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradlens import compat
from gradlens.core.sync import device_paths

__all__ = ["Kernel", "KINDS", "CHUNK_ELEMENTS", "check_kernel", "sample_chunks"]

#: elements of one transient block: a materialised ``[b, *param]`` slice, a ``T x T`` Gram
#: chunk, a chunk of the per-operation vjp (:mod:`gradlens.capture.ops`), a histogram product block
CHUNK_ELEMENTS = 1 << 22


def tgram_cheaper(d_out: int, d_in: int, t: int, n: int | None = None) -> bool:
    """Whether the ``[n, n]`` Gram of a layer with g_n = sum_t Dl_nt X_nt^T (``Dl [n, T, d_out]``,
    ``X [n, T, d_in]``) costs fewer multiply-adds from ``T x T`` factor products,
    ``(n T)^2 (d_in + d_out)``, than from the materialised ``[n, d_out d_in]`` gradients,
    ``n T d_in d_out`` (forming them) ``+ n^2 d_in d_out`` (their Gram), i.e. whether
    ``n T^2 (d_in + d_out) < d_in d_out (T + n)``. The left side grows faster in n: ``n=None``
    asks for every n (the limit ``T^2 (d_in + d_out) < d_in d_out``)."""
    if n is None:
        return t * t * (d_in + d_out) < d_in * d_out
    return n * t * t * (d_in + d_out) < d_in * d_out * (t + n)


def sample_chunks(numel_per_sample: int, batch: int, budget: int = CHUNK_ELEMENTS):
    """``(start, stop)`` slices of ``range(batch)`` with ``(stop - start) * numel_per_sample <=
    budget`` (at least one sample per slice)."""
    step = max(1, budget // max(numel_per_sample, 1))
    for s in range(0, batch, step):
        yield s, min(batch, s + step)


def _by_columns(fn: Callable[..., Tensor], *index: Tensor, width: int = 1) -> Tensor:
    """``fn(*index) -> [B, m]`` evaluated over slices of the ``[m]`` index tensors so that each
    slice's temporaries (``width`` numbers per column, e.g. B x positions) stay below
    :data:`CHUNK_ELEMENTS`; the slices are concatenated along the columns."""
    m = index[0].shape[0]
    step = max(1, CHUNK_ELEMENTS // max(width, 1))
    if m <= step:
        return fn(*index)
    return torch.cat([fn(*(t[s:s + step] for t in index)) for s in range(0, m, step)], dim=1)


class Kernel:
    """Default kernel: everything derived from materialised per-sample gradients.

    What a kernel offers is declared in class attributes (checked by :func:`check_kernel` when
    it is registered or first handed out by the registry); subclasses override only what they
    change. A kernel must define :meth:`per_sample`; everything else has a default."""

    #: the layer maths the cross-micro-step instruments may assume (one of :data:`KINDS`):
    #: ``"linear"`` (``F.linear`` factors a, delta; shared uses concatenate positions),
    #: ``"conv"`` (a ``_conv_forward`` along a direction), ``"bn"`` (an affine map of fixed
    #: statistics), ``"other"`` (materialised per-sample slices)
    kind: ClassVar[str] = "other"
    #: ``batch_l2`` / ``sum_grad_squared`` / ``grad_sum`` (and ``reduce``) come from the layer's
    #: factors without a ``[B, *param]`` tensor (or, for the norms' ``[B, C]``, from per-sample
    #: gradients no larger than one row of activations per sample), so the Lens runs no
    #: materialising pass over chunks of samples for them
    factored: ClassVar[bool] = False
    #: the layer's output mixes samples (batch statistics): the per-sample gradients of every
    #: parameter before it are undefined (the capture marks them)
    mixes_samples: ClassVar[bool] = False
    #: the per-sample maths read statistics of the layer's own micro-batch: pieces of several
    #: micro-steps must never be concatenated into one call
    per_micro_batch: ClassVar[bool] = False

    def params(self, module: nn.Module) -> list[str]:
        return [n for n, p in module.named_parameters(recurse=False) if p.requires_grad]

    def per_sample(self, module, a, delta, start: int, stop: int, attrs=None) -> dict[str, Tensor]:
        """``attrs``: only these parameters (default: all trainable); kernels may return more."""
        raise NotImplementedError

    def add_per_sample(self, module, a, delta, attr: str, out: Tensor) -> None:
        """``out += g_n`` of parameter ``attr`` for every sample (``out [B, *param]``)."""
        out.add_(self.per_sample(module, a, delta, 0, delta.shape[0], attrs=[attr])[attr])

    def entries(self, module, a, delta, attr: str, j: Tensor) -> Tensor:
        """``[B, m]``: the entries ``g_n[j]`` of parameter ``attr`` at the flat indices ``j``
        (``[m]``) for every sample n: what sampled histograms need, without the ``[B, *param]``
        tensor where the layer's maths allows. Default: materialised slices of samples, the
        columns gathered."""
        parts = [
            self.per_sample(module, a, delta, s, e, attrs=[attr])[attr].reshape(e - s, -1).index_select(1, j)
            for s, e in self._chunks(module, delta.shape[0])
        ]
        return torch.cat(parts)

    def stack_key(self, module, attrs: tuple[str, ...]):
        """What this kernel's per-sample maths of ``module`` depend on besides the shapes of the
        input and output gradient (hashable), if uses of several modules with equal keys and
        shapes may be measured as one call on their concatenated samples
        (:mod:`gradlens.measure.deferred`); None: never stacked (the default: maths that read the
        module's own statistics, parameters or buffers)."""
        return None

    def stacked_grad_sum(self, module, a, delta, k: int, attrs) -> dict[str, Tensor]:
        """sum_n g_n of each of ``k`` stacked uses (:mod:`gradlens.measure.deferred`; ``a``, ``delta``
        their inputs and output gradients concatenated along the sample axis, ``k`` equal
        blocks): attribute -> ``[k, *param]``. Default: the per-sample gradients summed per
        block (stacked uses are small); kernels with a factor form override it."""
        got = self.per_sample(module, a, delta, 0, delta.shape[0], attrs=list(attrs))
        return {attr: g.reshape(k, -1, *g.shape[1:]).sum(1) for attr, g in got.items()}

    def sum_cost(self, module, a: Tensor, out: Tensor) -> int:
        """About the multiply-adds of sum_n g_n of one use (input ``a``, output ``out``): what
        measuring it costs beside autograd's own dL/dp (:mod:`gradlens.measure.deferred`)."""
        return a.numel()

    def stacked_reduce(self, module, a, delta, k: int, groups: list[dict[str, str]], sums: dict, acc) -> tuple[list, dict]:
        """What :mod:`gradlens.measure.deferred` measures of ``k`` stacked uses (see
        :meth:`stacked_grad_sum`): the ``[k * b]`` ||g_n||^2 parts of each of ``groups``
        (attribute -> name dicts, as :meth:`reduce` returns them; ``acc`` as there, only its
        scratch buffers used) and, for the attributes ``sums[q]`` of each quantity ``q``
        (``"grad_sum"``, ``"sum_grad_squared"``), each use's sum over its samples: ``{q: {attr:
        [k, *param]}}`` (quantities without attributes left out). The sums of squares need
        the per-sample gradients: one materialising pass (:meth:`_stacked_materialised`) then
        gives the norms and window gradients too."""
        if sums.get("sum_grad_squared"):
            return self._stacked_materialised(module, a, delta, k, groups, sums)
        l2 = [self.reduce(module, a, delta, {"batch_l2"}, names, acc, ()) for names in groups]
        attrs = sums.get("grad_sum")
        return l2, ({"grad_sum": self.stacked_grad_sum(module, a, delta, k, attrs)} if attrs else {})

    def _stacked_materialised(self, module, a, delta, k: int, groups, sums: dict) -> tuple[list, dict]:
        """:meth:`stacked_reduce` from the per-sample gradients, formed for a few uses at a time
        (at most :data:`CHUNK_ELEMENTS` numbers): each attribute's squares serve its norms and
        its sum of squares."""
        wanted = list(dict.fromkeys([*(attr for names in groups for attr in names),
                                     *(attr for attrs in sums.values() for attr in attrs)]))
        n = delta.shape[0] // k
        step = max(1, CHUNK_ELEMENTS // max(n * self.numel(module, wanted), 1))
        l2: list[list[Tensor]] = [[] for _ in groups]
        got: dict[str, dict[str, list[Tensor]]] = {q: {attr: [] for attr in attrs} for q, attrs in sums.items() if attrs}
        shapes = {}
        for s in range(0, k, step):
            e = min(k, s + step)
            g = self.per_sample(module, a, delta, s * n, e * n, attrs=wanted)
            if not got:  # norms only: each group's in one pass over its attributes
                for j, names in enumerate(groups):
                    l2[j].append(joint_sq_norm(g, names))
                continue
            norms = {}
            for attr in wanted:
                rows = g[attr].reshape((e - s) * n, -1)
                shapes[attr] = g[attr].shape[1:]
                sq = rows.square()
                norms[attr] = sq.sum(1)
                if attr in got.get("sum_grad_squared", ()):
                    got["sum_grad_squared"][attr].append(sq.view(e - s, n, -1).sum(1))
                if attr in got.get("grad_sum", ()):
                    got["grad_sum"][attr].append(rows.reshape(e - s, n, -1).sum(1))
            for j, names in enumerate(groups):
                parts = [norms[attr] for attr in names]
                l2[j].append(parts[0] if len(parts) == 1 else torch.stack(parts).sum(0))
        out = {q: {attr: _cat(parts, dim=0).view(k, *shapes[attr]) for attr, parts in by.items()} for q, by in got.items()}
        return [[_cat(parts, dim=0)] for parts in l2], out

    def outer_factors(self, module, a, delta) -> dict[str, tuple[Tensor, Tensor]]:
        """Parameters whose per-sample gradient is the outer product ``delta_n a_n^T``:
        attribute -> (``delta [B, O]``, ``a [B, I]``). Empty for layers without that form."""
        return {}

    def _chunks(self, module, batch: int):
        return sample_chunks(sum(p.numel() for p in module.parameters(recurse=False)), batch)

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
            if q in want and any((q, attr) not in skip for attr in names):  # else all delivered
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

    # ---- cross-micro-step maths (see the module docstring) --------------------------------
    def matrix_dims(self, module) -> tuple[int, int] | None:
        return None

    def positions(self, module, a: Tensor, delta: Tensor) -> int:
        return 1

    def seq_factors(self, module, a: Tensor, delta: Tensor, attrs) -> tuple[Tensor, Tensor] | None:
        return None

    def use_tgram(self, module, a: Tensor, delta: Tensor, n: int | None = None) -> bool:
        return False

    @staticmethod
    def numel(module, attrs) -> int:
        """D_l: elements of the tracked parameters ``attrs`` of ``module``."""
        return sum(getattr(module, attr).numel() for attr in attrs)

    def flat_per_sample(self, module, a: Tensor, delta: Tensor, start: int, stop: int, attrs) -> Tensor:
        """``[stop - start, D_l]``: per-sample gradients of ``attrs``, flattened in that order."""
        got = self.per_sample(module, a, delta, start, stop)
        return _cat([got[attr].flatten(1) for attr in attrs], dim=1)

    def directional(self, module, a: Tensor, delta: Tensor, direction: dict[str, Tensor], attrs) -> Tensor:
        """``[B]``: ``<D, g_n>``, ``D`` = ``direction`` (attribute -> ``[*param]``; untracked
        parameters count as 0). Here: materialised ``[b, D_l]`` slices dotted with D."""
        flat = torch.cat([direction[attr].to(delta.dtype).flatten() for attr in attrs])
        chunks = sample_chunks(self.numel(module, attrs), delta.shape[0])
        return torch.cat([self.flat_per_sample(module, a, delta, s, e, attrs) @ flat for s, e in chunks])

    def gram(self, module, pieces: list[tuple[Tensor, Tensor]], attrs) -> Tensor:
        """``[n, n]`` g_n . g_m over ``attrs`` for the samples of ``pieces`` (list of ``(a,
        delta)`` per micro-step, concatenated in order): sums of ``T x T`` factor products where
        :meth:`use_tgram`, else the materialised ``[n, D_l]`` times its transpose."""
        a0, d0 = pieces[0]
        if self.use_tgram(module, a0, d0, sum(d.shape[0] for _, d in pieces)):
            facs = [self.seq_factors(module, a, d, attrs) for a, d in pieces]
            X = torch.cat([f[0] for f in facs])
            Dl = torch.cat([f[1] for f in facs])
            n, t = X.shape[0], X.shape[1]
            X2, D2 = X.reshape(n * t, -1), Dl.reshape(n * t, -1)
            out = []
            for s, e in sample_chunks(n * t * t, n):
                blk = (X2[s * t : e * t] @ X2.T) * (D2[s * t : e * t] @ D2.T)
                out.append(blk.view(e - s, t, n, t).sum((1, 3)))
            return torch.cat(out)
        numel = self.numel(module, attrs)
        G = _cat(
            [
                self.flat_per_sample(module, a, d, s, e, attrs)
                for a, d in pieces
                for s, e in sample_chunks(numel, d.shape[0])
            ]
        )
        return G @ G.T

    def gram_materialises(self, module, a: Tensor, delta: Tensor) -> bool:
        """Whether :meth:`gram` forms the ``[n, D_l]`` per-sample gradients (memory budget)."""
        return not self.use_tgram(module, a, delta)

    def mean_via_gram(self, module, a: Tensor, delta: Tensor, n: int) -> bool:
        """Whether ``g_n . G`` for the mean G of n samples is cheaper as ``(1/n) sum_m K_nm``."""
        return False

    def sketch(self, module, a: Tensor, delta: Tensor, attrs, k: int, pair) -> Tensor:
        """``[B, k]``: R g_n. Matrix layers: one ``[d_out, d_in + 1]`` block (bias column),
        from the factors or from materialised slices, whichever is cheaper (same numbers);
        others: one block per attribute ``[shape[0], -1]`` from materialised slices."""
        dims = self.matrix_dims(module)
        if dims is not None:
            d_out, d_in = dims
            u, v = pair("wb", d_out, d_in + 1)
            vw, vb = v[:, :d_in], v[:, d_in]
            t = self.positions(module, a, delta)
            # per sample: factor route T k (d_in + d_out); materialising route (form g_n, then
            # u^T G v) T d_in d_out + k d_in d_out.
            if t * k * (d_in + d_out) > (t + k) * d_in * d_out:
                return self.sketch_materialised(module, a, delta, attrs, u, vw, vb)
            return self.sketch_factors(module, a, delta, attrs, u, vw, vb)
        out = []
        for s, e in sample_chunks(self.numel(module, attrs), delta.shape[0]):
            got = self.per_sample(module, a, delta, s, e)
            acc = delta.new_zeros(e - s, k)
            for attr in attrs:
                g = got[attr].reshape(e - s, got[attr].shape[1] if got[attr].dim() > 1 else 1, -1)
                u, v = pair(attr, g.shape[1], g.shape[2])
                acc = acc + ((g @ v.T) * u.T).sum(1)
            out.append(acc)
        return torch.cat(out)

    def sketch_factors(self, module, a, delta, attrs, u: Tensor, vw: Tensor, vb: Tensor) -> Tensor:
        """``[B, k]``: the sketch of a matrix layer from its factors (``u [k, d_out]``, ``vw [k,
        d_in]``, ``vb [k]``), ``s_nj = sum_t (u_j . delta_nt)(vw_j . a_nt + vb_j)``."""
        raise NotImplementedError

    def sketch_materialised(self, module, a, delta, attrs, u: Tensor, vw: Tensor, vb: Tensor) -> Tensor:
        """``[B, k]``: the same sketch as :meth:`sketch_factors`, from materialised slices."""
        d_out, d_in = self.matrix_dims(module)
        out = []
        for s, e in sample_chunks(self.numel(module, attrs), delta.shape[0]):
            got = self.per_sample(module, a, delta, s, e)
            acc = delta.new_zeros(e - s, u.shape[0])
            if "weight" in attrs:
                acc = acc + ((u @ got["weight"].reshape(e - s, d_out, d_in)) * vw).sum(2)
            if "bias" in attrs:
                acc = acc + (got["bias"] @ u.T) * vb
            out.append(acc)
        return torch.cat(out)

    def sketch_direction(self, module, direction: dict[str, Tensor], attrs, k: int, pair, like: Tensor) -> Tensor:
        """``[k]``: R D for ``direction`` (attribute -> ``[*param]``), the blocks of :meth:`sketch`."""
        D = {key: v.to(like.dtype) for key, v in direction.items()}
        dims = self.matrix_dims(module)
        out = like.new_zeros(k)
        if dims is not None:
            d_out, d_in = dims
            u, v = pair("wb", d_out, d_in + 1)
            if "weight" in D:
                out = out + ((u @ D["weight"].reshape(d_out, d_in)) * v[:, :d_in]).sum(1)
            if "bias" in D:
                out = out + (u @ D["bias"]) * v[:, d_in]
            return out
        for attr in attrs:
            p = D[attr]
            mat = p.reshape(p.shape[0] if p.dim() > 0 else 1, -1)
            u, v = pair(attr, mat.shape[0], mat.shape[1])
            out = out + ((u @ mat) * v).sum(1)
        return out


#: the values of :attr:`Kernel.kind`
KINDS = frozenset({"linear", "conv", "bn", "other"})

#: methods a kind's cross-micro-step maths need beyond the materialising defaults of
#: :class:`Kernel` (``sketch_factors`` has no default: the base raises)
_KIND_METHODS = {
    "linear": ("matrix_dims", "positions", "seq_factors", "use_tgram", "directional", "gram",
               "sketch_factors"),
    "conv": ("matrix_dims", "positions", "directional", "sketch_factors"),
    "bn": ("directional",),
    "other": (),
}
_FLAGS = ("factored", "mixes_samples", "per_micro_batch")
_SUMS = ("batch_l2", "sum_grad_squared", "grad_sum")


def _overrides(cls: type, name: str) -> bool:
    return getattr(cls, name) is not getattr(Kernel, name)


def check_kernel(kernel: object) -> None:
    """Check what ``kernel`` declares (:attr:`Kernel.kind`, :attr:`Kernel.factored`,
    :attr:`Kernel.mixes_samples`, :attr:`Kernel.per_micro_batch`) against what it implements;
    raises ``TypeError`` / ``ValueError`` naming the class, the attribute and the fix.

    Called by :func:`gradlens.capture.registry.register_kernel` for a kernel instance, and by
    :func:`gradlens.capture.registry.kernel_for` on the first kernel of each class a factory returns
    (when a Lens is built)."""
    if isinstance(kernel, type):
        raise TypeError(
            f"kernel {kernel.__name__} is a class; pass an instance, e.g. {kernel.__name__}()"
        )
    if not isinstance(kernel, Kernel):
        raise TypeError(
            f"kernel must be a gradlens.kernels.Kernel, got {type(kernel).__name__} ({kernel!r}); "
            "subclass gradlens.kernels.Kernel and define per_sample(self, module, a, delta, "
            "start, stop, attrs=None)"
        )
    cls = type(kernel)
    name = cls.__name__
    if not _overrides(cls, "per_sample"):
        raise TypeError(
            f"{name} does not define per_sample; every kernel needs per_sample(self, module, a, "
            "delta, start, stop, attrs=None) -> {attribute: [stop - start, *param]}"
        )
    for flag in _FLAGS:
        value = getattr(kernel, flag)
        if not isinstance(value, bool):
            raise TypeError(
                f"{name}.{flag} must be True or False, got {value!r}; set the class attribute "
                f"{flag} = True (or leave it out for False)"
            )
    kind = kernel.kind
    if not isinstance(kind, str) or kind not in KINDS:
        raise ValueError(
            f"{name}.kind must be one of {sorted(KINDS)}, got {kind!r}; use kind = \"other\" "
            "unless the kernel implements that kind's factor forms"
        )
    missing = [m for m in _KIND_METHODS[kind] if not _overrides(cls, m)]
    if missing:
        raise TypeError(
            f"{name}.kind = {kind!r} but {name} does not define {missing}; define them, or set "
            "kind = \"other\" (materialised per-sample slices)"
        )
    if kernel.factored:
        missing = [m for m in _SUMS if not _overrides(cls, m)]
        if missing:
            raise TypeError(
                f"{name}.factored = True but {name} does not define {missing} (Kernel's versions "
                "materialise per-sample gradients); define them from the layer's factors, or set "
                "factored = False"
            )
    if _overrides(cls, "matrix_dims") and not _overrides(cls, "sketch_factors"):
        raise TypeError(
            f"{name} defines matrix_dims but not sketch_factors, which sketches of matrix layers "
            "call; define sketch_factors(self, module, a, delta, attrs, u, vw, vb), or do not "
            "define matrix_dims"
        )


def _cat(tensors: list[Tensor], dim: int = 0) -> Tensor:
    """``torch.cat`` without the copy when there is one tensor."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=dim)


def add_into(acc: dict[str, Tensor], key: str, v: Tensor) -> None:
    if key in acc:
        acc[key].add_(v)
    else:
        acc[key] = v


def joint_sq_norm(g: dict[str, Tensor], names) -> Tensor:
    """``[B]`` ||g_n||^2 over the attributes ``names`` of the per-sample gradients ``g``
    (attribute -> ``[B, *param]``), in one pass."""
    flat = [g[attr].flatten(1) for attr in names]
    return (torch.cat(flat, 1) if len(flat) > 1 else flat[0]).square().sum(1)


def _add_row_sum(acc: Tensor, ones: Tensor, f: Tensor) -> None:
    """``acc += sum_n f_n`` (``f [b, numel]``, ``ones [1, b]``) as one ``1^T f`` product
    written into ``acc`` (any accumulator layout or dtype: then through a temporary)."""
    if acc.dtype == f.dtype and acc.is_contiguous():
        acc.view(1, -1).addmm_(ones, f)
    else:
        acc.add_((ones @ f).view(acc.shape))


def _zeros_into(acc: dict[str, Tensor], key: str, shape: tuple[int, ...], like: Tensor) -> None:
    """acc[key] = zeros of ``shape`` (in the buffer the accumulator dict offers for ``key``,
    see :func:`_addmm_into`), for sums that many in-place adds then build."""
    buffer = getattr(acc, "buffer", None)
    out = buffer(key, shape, like) if buffer else None
    acc[key] = like.new_zeros(shape) if out is None else out.zero_()


def _addmm_into(acc: dict[str, Tensor], key: str, m1: Tensor, m2: Tensor) -> None:
    """acc[key] += m1 @ m2. The first product of a window is written into the buffer the
    accumulator dict offers for ``key`` (``acc.buffer(key, shape, like)``, see
    :class:`gradlens.core.stats.Accumulators`) so that large sums reuse memory across
    windows instead of faulting in fresh pages every step."""
    if key in acc:
        acc[key].addmm_(m1, m2)
        return
    buffer = getattr(acc, "buffer", None)
    out = buffer(key, (m1.shape[0], m2.shape[1]), m1) if buffer else None
    acc[key] = m1 @ m2 if out is None else torch.mm(m1, m2, out=out)


class _LinearSums(Kernel):
    """The per-sample sums of an affine map with input ``[B, *, d_in]`` and output gradient
    ``[B, *, d_out]``: g_n = sum_t delta_nt a_nt^T (``[d_out, d_in]`` layout), from the
    factors. :class:`LinearKernel` adds the cross-micro-step factor forms; Hugging Face's
    transposed ``Conv1D`` (:class:`TransposedLinearKernel`) keeps the materialising ones."""

    factored = True
    #: the weight is ``[d_in, d_out]`` (transformers' ``Conv1D``), not ``[d_out, d_in]``
    _transposed = False

    @staticmethod
    def _flat(module, a, delta):
        b = delta.shape[0]
        return a.reshape(b, -1, a.shape[-1]), delta.reshape(b, -1, delta.shape[-1])

    def stack_key(self, module, attrs):
        return ()  # the norms read the input and output gradient only

    def sum_cost(self, module, a, out):
        return a.numel() * out.shape[-1]  # the weight's product

    def stacked_grad_sum(self, module, a, delta, k, attrs):
        x = a.reshape(k, -1, a.shape[-1])  # [k, b * T, d_in]: block i is use i's positions
        d = delta.reshape(k, -1, delta.shape[-1])
        out = {}
        if "weight" in attrs:  # one batched product for the k uses
            out["weight"] = torch.bmm(x.transpose(1, 2), d) if self._transposed else torch.bmm(d.transpose(1, 2), x)
        if "bias" in attrs:
            out["bias"] = d.sum(1)
        return out

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

    def entries(self, module, a, delta, attr, j):
        # (index_select: several times faster than advanced indexing for column gathers)
        if delta.dim() == 2:  # no sequence axis: g_n[o, i] = delta_no a_ni
            if attr == "bias":
                return delta.index_select(1, j)
            o, i = self._weight_index(module, j)
            return delta.index_select(1, o).mul_(a.index_select(1, i))
        x, d = self._flat(module, a, delta)  # [B, T, I], [B, T, O]
        width = d.shape[0] * d.shape[1]
        if attr == "bias":
            return _by_columns(lambda jk: d.index_select(2, jk).sum(1), j, width=width)
        o, i = self._weight_index(module, j)
        return _by_columns(lambda ok, ik: (d.index_select(2, ok) * x.index_select(2, ik)).sum(1),
                           o, i, width=width)

    @staticmethod
    def _weight_index(module, j: Tensor) -> tuple[Tensor, Tensor]:
        """(output row, input column) of flat weight index j (``[O, I]`` layout)."""
        width = module.in_features
        return j // width, j % width

    def outer_factors(self, module, a, delta):
        if delta.dim() != 2 or "weight" not in self.params(module) or device_paths(delta):
            return {}  # (the factor fast paths are CPU shortcuts with host reads)
        if not (torch.isfinite(a).all() and torch.isfinite(delta).all()):
            return {}  # inf * 0 = nan: let the materialised path see what autograd would
        return {"weight": (delta, a)}

    def reduce(self, module, a, delta, want, names, acc, skip=()):
        if delta.dim() != 2:
            return self._reduce_seq(module, a, delta, want, names, acc, skip)
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
            if b and ("grad_sum", "bias") not in skip:
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

    def _reduce_seq(self, module, a, delta, want, names, acc, skip, transposed: bool = False):
        """Inputs with a sequence axis ``[B, T, d]``. The sum of squares needs g_n itself: one
        materialising pass then gives the norms and the weight sum too. Each chunk of samples
        (:func:`sample_chunks`) is formed into one reused buffer and reduced in place, with no
        allocation per chunk: the norms as vector norms, the sums as ``1^T G`` products added
        into the window's accumulators, the squares in place. Without it, norms come from
        T x T Gram products and the sum from one matmul. ``transposed``: the weight is
        ``[d_in, d_out]`` (transformers' ``Conv1D``), g_n = sum_t a_nt delta_nt^T is formed in
        that layout."""
        w, b = names.get("weight"), names.get("bias")
        x, d = self._flat(module, a, delta)
        out = []
        b_l2 = True  # the bias' ||g_n||^2 still to add (not in the weight's Gram sum)
        if "sum_grad_squared" in want and w:
            n, shape = d.shape[0], tuple(module.weight.shape)
            numel = shape[0] * shape[1]
            sgs = acc["sum_grad_squared"]
            gsum = "grad_sum" in want and ("grad_sum", "weight") not in skip
            # a fused Linear call (gradlens.capture.WeightGrad, per-sample scale): dL/dW of this
            # call is sum_n g_n / scale, summed here instead of by autograd's own matmul
            fused = acc.get("weight_grad")
            wsum = d.new_zeros(shape) if fused is not None else None
            for q, on in (("sum_grad_squared", True), ("grad_sum", gsum and wsum is None)):
                if on and w not in acc[q]:  # zeros (in the pool's buffer): every chunk adds in
                    _zeros_into(acc[q], w, shape, d)
            chunks = list(sample_chunks(numel, n))
            c = chunks[0][1]
            scratch = getattr(sgs, "scratch", None)
            like = d[0, :1, :1].expand(c, numel)
            buf = scratch("g_n", like) if scratch is not None else None
            if buf is None:
                buf = d.new_empty(c, numel)
            ones = d.new_ones(1, c)
            l2w = d.new_empty(n) if "batch_l2" in want else None
            left, right = (x.transpose(1, 2), d) if transposed else (d.transpose(1, 2), x)  # [B, *, T], [B, T, *]
            for s, e in chunks:
                f = buf[: e - s]  # [b, numel] in the weight's layout
                torch.bmm(left[s:e], right[s:e], out=f.view(e - s, *shape))
                if l2w is not None:  # (one pass over f; a batched dot through bmm is 4x slower)
                    torch.linalg.vector_norm(f, dim=1, out=l2w[s:e])
                if wsum is not None:
                    _add_row_sum(wsum, ones[:, : e - s], f)
                elif gsum:
                    _add_row_sum(acc["grad_sum"][w], ones[:, : e - s], f)
                f.square_()
                _add_row_sum(sgs[w], ones[:, : e - s], f)
            if l2w is not None:
                out.append(l2w.square_())
            if wsum is not None:
                holder, scale = fused
                holder.value = (wsum / scale).to(module.weight.dtype)
                if gsum:
                    add_into(acc["grad_sum"], w, wsum)
        else:
            if "grad_sum" in want and w and ("grad_sum", "weight") not in skip:
                xf, df = x.reshape(-1, x.shape[-1]), d.reshape(-1, d.shape[-1])
                _addmm_into(acc["grad_sum"], w, *((xf.t(), df) if transposed else (df.t(), xf)))
            if "batch_l2" in want and w:
                t = d.shape[1]
                if 2 * t * t <= x.shape[-1] * d.shape[-1]:  # T x T Grams: ||g_n||^2 = <A A^T, D D^T>
                    gd = torch.bmm(d, d.transpose(1, 2))
                    gx = torch.bmm(x, x.transpose(1, 2))
                    if b:  # + the bias: ||sum_t d_nt||^2 = 1^T D D^T 1, in the same sum
                        out.append(gx.add_(1).mul_(gd).sum((1, 2)))
                        b_l2 = False
                    else:
                        out.append(gx.mul_(gd).sum((1, 2)))
                else:
                    out.append(self.batch_l2(module, a, delta)["weight"])
        # the bias' quantities still to form (its norms may already be in the Gram sum)
        squares, total, norms = ("sum_grad_squared" in want, "grad_sum" in want and ("grad_sum", "bias") not in skip,
                                 "batch_l2" in want and b_l2)
        if b and (squares or total or norms):
            db = d.sum(1)  # [B, O]: the bias gradient of each sample
            if squares:
                add_into(acc["sum_grad_squared"], b, db.square().sum(0))
            if total:
                add_into(acc["grad_sum"], b, db.sum(0))
            if norms:
                out.append(db.square().sum(1))
        return out if "batch_l2" in want else []

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


class LinearKernel(_LinearSums):
    """``nn.Linear`` (and ``F.linear`` calls, :class:`OpLinear`) with input ``[B, *, d_in]``;
    g_n = sum_t delta_nt a_nt^T. The sums come from the factors (:class:`_LinearSums`); the
    cross-micro-step maths (Gram, projections, sketches) too."""

    kind = "linear"

    def add_per_sample(self, module, a, delta, attr, out):
        x, d = self._flat(module, a, delta)
        if (attr == "weight" and delta.dim() != 2 and out.is_contiguous()
                and out.dtype == delta.dtype and out.shape == (d.shape[0], d.shape[-1], x.shape[-1])):
            out.view(d.shape[0], d.shape[-1], x.shape[-1]).baddbmm_(d.transpose(1, 2), x)
            return
        super().add_per_sample(module, a, delta, attr, out)

    # ---- cross-micro-step maths: the factor forms
    def matrix_dims(self, module):
        return module.out_features, module.in_features

    def positions(self, module, a, delta):
        return delta[0].numel() // delta.shape[-1]

    def seq_factors(self, module, a, delta, attrs):
        x, d = self._flat(module, a, delta)
        return _with_bias_column(x, attrs), d

    def use_tgram(self, module, a, delta, n=None):
        d_out, d_in = self.matrix_dims(module)
        return tgram_cheaper(d_out, d_in, self.positions(module, a, delta), n)

    def directional(self, module, a, delta, direction, attrs):
        b = delta.shape[0]
        D = {key: v.to(delta.dtype) for key, v in direction.items()}
        out = delta.new_zeros(b)
        d = delta.reshape(b, -1, delta.shape[-1])
        if "weight" in D:
            x = a.reshape(b, -1, a.shape[-1])
            out = out + (d * F.linear(x, D["weight"])).sum((1, 2))
        if "bias" in D:
            out = out + d.sum(1) @ D["bias"]
        return out

    def gram(self, module, pieces, attrs):
        """Without a sequence axis: ``(A A^T + 1[bias]) * (Delta Delta^T)``. With one: ``T x T``
        factor products where :func:`tgram_cheaper`, else :meth:`_gram_row_blocks`."""
        if pieces[0][1].dim() != 2:
            n = sum(d.shape[0] for _, d in pieces)
            same_t = len({self.positions(module, a, d) for a, d in pieces}) == 1
            if same_t and self.use_tgram(module, pieces[0][0], pieces[0][1], n):
                return super().gram(module, pieces, attrs)
            return self._gram_row_blocks(module, pieces, attrs)
        A = torch.cat([p[0] for p in pieces])
        Dl = torch.cat([p[1] for p in pieces])
        k = Dl @ Dl.T
        if "weight" in attrs:
            ka = A @ A.T
            k = k * (ka + 1) if "bias" in attrs else k * ka
        return k

    def gram_with_sum(self, module, a, delta, attrs) -> tuple[Tensor, Tensor | None]:
        """``([B, B] Gram, [d_out, d_in] sum_n g_n of the weight or None)`` of one micro-step's
        sequence input: the Gram of :meth:`gram`; where that materialises weight row blocks
        (:meth:`_gram_row_blocks`), the weight sum comes from the same blocks (what a fused
        Linear call takes as its dL/dW), else None."""
        if delta.dim() == 2 or "weight" not in attrs or self.use_tgram(module, a, delta, delta.shape[0]):
            return self.gram(module, [(a, delta)], attrs), None
        d_out, d_in = self.matrix_dims(module)
        wsum = delta.new_empty(d_out, d_in)  # every row block writes its rows once
        return self._gram_row_blocks(module, [(a, delta)], attrs, wsum, write_sum=True), wsum

    def _gram_row_blocks(self, module, pieces, attrs, wsum: Tensor | None = None, write_sum: bool = False):
        """``[n, n]`` Gram of a sequence Linear from materialised per-sample gradients, one block
        of weight rows at a time: ``K = sum_blocks G_r G_r^T + Db Db^T`` with ``G_r [n, rows,
        d_in]`` the rows ``r`` of every g_n (``Dl_n[:, r]^T X_n``, written into one reused
        buffer of at most :data:`CHUNK_ELEMENTS` elements, or one row when ``n d_in`` is more)
        and ``Db [n, d_out]`` the bias gradients. Memory stays bounded: nothing of size
        ``[n, D_l]`` is formed. ``wsum`` (``[d_out, d_in]``, optional): the blocks' sum over
        samples is added into it (``write_sum``: written, its old contents ignored)."""
        flats = [self._flat(module, a, d) for a, d in pieces]  # (X [b, T, d_in], Dl [b, T, d_out])
        n = sum(d.shape[0] for _, d in flats)
        d_out, d_in = self.matrix_dims(module)
        K = None
        if "weight" in attrs:
            rows = max(1, min(d_out, CHUNK_ELEMENTS // max(n * d_in, 1)))
            buf = flats[0][1].new_empty(n * rows * d_in)
            ones = buf.new_ones(1, n)
            for r0 in range(0, d_out, rows):
                r1 = min(d_out, r0 + rows)
                blk = buf[: n * (r1 - r0) * d_in].view(n, r1 - r0, d_in)
                s = 0
                for x, d in flats:
                    torch.bmm(d[:, :, r0:r1].transpose(1, 2), x, out=blk[s : s + d.shape[0]])
                    s += d.shape[0]
                f = blk.view(n, -1)
                K = f @ f.T if K is None else K.addmm_(f, f.T)
                if wsum is not None and write_sum and wsum.is_contiguous() and wsum.dtype == f.dtype:
                    torch.mm(ones, f, out=wsum[r0:r1].view(1, -1))
                elif wsum is not None:
                    if write_sum:
                        wsum[r0:r1].zero_()
                    _add_row_sum(wsum[r0:r1], ones, f)
        if "bias" in attrs:
            db = _cat([d.sum(1) for _, d in flats])
            K = db @ db.T if K is None else K.addmm_(db, db.T)
        return K

    def gram_materialises(self, module, a, delta):
        return False  # factor forms, T x T blocks or bounded row blocks: never [n, D_l]

    def mean_via_gram(self, module, a, delta, n):
        if delta.dim() != 2:
            return super().mean_via_gram(module, a, delta, n)
        d_out, d_in = self.matrix_dims(module)
        return n * (d_out + d_in) < d_out * d_in

    def sketch_factors(self, module, a, delta, attrs, u, vw, vb):
        b = delta.shape[0]
        ud = delta.reshape(b, -1, u.shape[1]) @ u.T  # [B, T, k]
        va = 0
        if "weight" in attrs:
            va = a.reshape(b, -1, vw.shape[1]) @ vw.T
        if "bias" in attrs:
            va = va + vb
        return (ud * va).sum(1)


def _with_bias_column(x: Tensor, attrs) -> Tensor:
    """``[B, T, d_in (+1)]``: the weight's input factor and, if the bias is tracked, a column of
    ones (the bias as one more input)."""
    cols = []
    if "weight" in attrs:
        cols.append(x)
    if "bias" in attrs:
        cols.append(x.new_ones(x.shape[0], x.shape[1], 1))
    return torch.cat(cols, dim=2) if len(cols) > 1 else cols[0]


class _ConvMaths:
    """Cross-micro-step maths of convolutions (``kind = "conv"``: a ``_conv_forward`` along a
    direction), mixed in before :class:`Kernel`; transposed convolutions keep the base versions
    (:class:`BackpackKernel`, :class:`VmapConvKernel`)."""

    kind: ClassVar[str] = "conv"

    def matrix_dims(self, module):
        if module.groups != 1:  # no single matrix: one sketch block per attribute
            return super().matrix_dims(module)
        return module.out_channels, module.weight[0].numel()

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
            va = compat.conv_forward(module, a, vw.reshape(-1, *module.weight.shape[1:]), None).flatten(2)
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


class Conv2dKernel(_ConvMaths, Kernel):
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

    def entries(self, module, a, delta, attr, j):
        d = delta.flatten(2)  # [B, C_out, L]
        width = d.shape[0] * d.shape[2]
        if attr == "bias":
            return d.index_select(1, j).sum(-1)
        a, padding = _explicit_padding(module, a)
        if any(padding):
            ph, pw = padding
            a = F.pad(a, (pw, pw, ph, ph))
        c_out, c_per, kh, kw = module.weight.shape
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
                a, module.weight.shape, d, module.stride, padding, module.dilation
            )
        if "bias" in names:
            out["bias"] = d.sum((0, 2, 3))
        return out


class BatchNormEvalKernel(Kernel):
    """``nn.BatchNorm{1,2,3}d`` in eval mode: a per-channel affine map of the running statistics."""

    kind = "bn"

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

    def entries(self, module, a, delta, attr, j):
        idx, d = self._flat(module, a, delta)  # [B, T], [B, T, D]
        v, k = j // module.embedding_dim, j % module.embedding_dim
        return _by_columns(lambda vk, kk: ((idx[:, :, None] == vk) * d.index_select(2, kk)).sum(1),
                           v, k, width=idx.numel())

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


# =============================================================================== norms
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
        return {attr: g.flatten(1).square().sum(1) for attr, g in self.per_sample(module, a, delta, 0, delta.shape[0]).items()}

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


# =============================================================================== Linear-likes
class TransposedLinearKernel(_LinearSums):
    """Hugging Face ``transformers``' ``Conv1D``: ``y = x @ W + b`` with ``W [d_in, d_out]``;
    g_n(W) = sum_t a_nt delta_nt^T (the transpose of ``nn.Linear``'s). The sums come from the
    factors; projections and Grams from ``nn.Linear``'s factor forms on W^T; sketches from
    materialised slices. ``kind = "other"``: shared uses are summed as ``[B, *param]``, not
    concatenated as ``F.linear`` factors."""

    _transposed = True

    class _AsLinear:
        """The module as the ``nn.Linear`` of W^T: ``in_features``, ``out_features``, its
        parameters."""

        def __init__(self, module):
            self.in_features, self.out_features = module.weight.shape
            self._m = module

        def named_parameters(self, recurse=False):
            return self._m.named_parameters(recurse=False)

    def per_sample(self, module, a, delta, start, stop, attrs=None):
        attrs = self.params(module) if attrs is None else attrs
        out = {}
        x, d = self._flat(module, a[start:stop], delta[start:stop])
        if "weight" in attrs:  # [b, d_in, d_out], contiguous in W's layout
            out["weight"] = torch.bmm(x.transpose(1, 2), d) if delta.dim() != 2 else torch.einsum("ni,no->nio", a[start:stop], delta[start:stop])
        if "bias" in attrs:
            out["bias"] = d.sum(1) if delta.dim() != 2 else delta[start:stop]
        return out

    def entries(self, module, a, delta, attr, j):
        return super().entries(self._AsLinear(module), a, delta, attr, j)

    @staticmethod
    def _weight_index(module, j: Tensor) -> tuple[Tensor, Tensor]:
        width = module.out_features  # W is [d_in, d_out]: j = i * d_out + o
        return j % width, j // width

    def outer_factors(self, module, a, delta):
        got = super().outer_factors(module, a, delta)
        return {"weight": (a, delta)} if got else {}

    # ---- cross-micro-step maths: nn.Linear's factor forms on W^T (g_n . g_m does not depend
    # on the layout; a direction's weight is transposed). The sketch keeps the per-attribute
    # blocks of materialised slices (no matrix_dims): its random blocks follow W's own layout.
    def directional(self, module, a, delta, direction, attrs):
        D = dict(direction)
        if "weight" in D:
            D["weight"] = D["weight"].t()
        return _LINEAR.directional(self._AsLinear(module), a, delta, D, attrs)

    def gram(self, module, pieces, attrs):
        return _LINEAR.gram(self._AsLinear(module), pieces, attrs)

    def gram_materialises(self, module, a, delta):
        return False  # T x T blocks or bounded row blocks, as nn.Linear's

    def mean_via_gram(self, module, a, delta, n):
        return _LINEAR.mean_via_gram(self._AsLinear(module), a, delta, n)

    def reduce(self, module, a, delta, want, names, acc, skip=()):
        if delta.dim() != 2:
            # in W's [d_in, d_out] layout, as nn.Linear's: one materialising pass gives the sum
            # of squares, the norms and the sums, not a transposed slice per quantity; without
            # the sum of squares the norms come from T x T Grams
            return self._reduce_seq(module, a, delta, want, names, acc, skip, transposed=True)
        return Kernel.reduce(self, module, a, delta, want, names, acc, skip)

    def batch_l2(self, module, a, delta):
        lin = self._AsLinear(module)  # ||g_n||^2 is the same for the transposed weight
        if delta.dim() != 2 and not self._use_gram(lin, delta[0].numel() // delta.shape[-1]):
            return Kernel.batch_l2(self, module, a, delta)  # long sequences: materialised slices
        return super().batch_l2(lin, a, delta)

    def sum_grad_squared(self, module, a, delta):
        if delta.dim() != 2:
            return Kernel.sum_grad_squared(self, module, a, delta)
        out = {"weight": a.square().t() @ delta.square(), "bias": delta.square().sum(0)}
        return {n: out[n] for n in self.params(module)}

    def grad_sum(self, module, a, delta):
        x = a.reshape(-1, a.shape[-1])
        d = delta.reshape(-1, delta.shape[-1])
        out = {"weight": x.t() @ d, "bias": d.sum(0)}
        return {n: out[n] for n in self.params(module)}


#: nn.Linear's maths, for layers that present themselves as one (TransposedLinearKernel)
_LINEAR = LinearKernel()


class OpLinear:
    """A functional ``F.linear(x, weight, bias)`` call seen during a tracked forward, presented
    to :class:`LinearKernel` as if it were an ``nn.Linear`` (only the tracked parameters count).
    Also the union of several calls of the same weight, their positions concatenated."""

    def __init__(self, weight: Tensor, bias: Tensor | None, tracked: tuple[str, ...]):
        self.weight, self.bias = weight, bias
        self.out_features, self.in_features = weight.shape
        self._tracked = tracked

    def named_parameters(self, recurse: bool = False):
        return [(n, getattr(self, n)) for n in self._tracked]

    def parameters(self, recurse: bool = False):
        return [p for _, p in self.named_parameters()]


class Materialised:
    """A parameter whose per-sample gradients were formed explicitly (shared parameters summed
    over their uses, or the exact per-operation fallback): ``per_sample`` of
    :class:`MaterialisedKernel` reads slices of the stored ``[B, *param]`` tensor (passed as
    the kernel's ``a``)."""

    def __init__(self, attr: str, param: Tensor):
        setattr(self, attr, param)
        self._attr = attr

    def named_parameters(self, recurse: bool = False):
        return [(self._attr, getattr(self, self._attr))]

    def parameters(self, recurse: bool = False):
        return [getattr(self, self._attr)]


class MaterialisedKernel(Kernel):
    """Kernel of a :class:`Materialised` parameter: ``a`` is ``[B, *param]``, ``delta`` unused.
    The per-sample gradients are its input, so the sums and norms are reductions of it
    (``factored``: no materialising pass; the sum of squares squares bounded slices)."""

    factored = True

    def batch_l2(self, module, a, delta):
        return {module._attr: torch.linalg.vector_norm(a.flatten(1), dim=1).square()}

    def sum_grad_squared(self, module, a, delta):
        # Kernel's chunked squares are right here (the slices are the input itself); defined
        # so that check_kernel sees that a factored kernel states its own sums
        return super().sum_grad_squared(module, a, delta)

    def grad_sum(self, module, a, delta):
        return {module._attr: a.sum(0)}

    def per_sample(self, module, a, delta, start, stop, attrs=None):
        return {module._attr: a[start:stop]}

    def entries(self, module, a, delta, attr, j):
        return a.reshape(a.shape[0], -1).index_select(1, j)


