"""The kernel contract: the :class:`Kernel` base class, :func:`check_kernel`, and the helpers
every layer family shares (the one chunking rule, accumulator adds, joint norms).

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
  :func:`gradlens.capture.fused._fused_forward`).
- ``gram_materialises(module, a, delta)``: whether :meth:`Kernel.gram` forms ``[n, D_l]``.
- ``mean_via_gram(module, a, delta, n)``: whether ``g_n . G`` (G the mean of n samples) is
  cheaper as row sums of the Gram than through G.
- ``sketch(module, a, delta, attrs, k, pair)``: ``[B, k]``, ``R g_n`` for the Rademacher
  pairs ``pair(block, rows, cols) -> (u [k, rows] / sqrt(k), v [k, cols])`` (one block ``"wb"``
  ``[d_out, d_in + 1]`` for matrix layers, one per attribute otherwise).
- ``sketch_direction(module, direction, attrs, k, pair, like)``: ``[k]``, ``R D``.

What a kernel offers beyond the methods is declared on its class (:class:`Kernel`'s class
attributes, checked by :func:`check_kernel`): the layer maths the cross-micro-step instruments
may assume, whether its sums come from factors, whether it mixes samples, and the capture's fast
paths it supports.

One chunking rule: whatever materialises per-sample slices takes ``b`` samples at a time with
``b * numel_per_sample <= budget`` (:func:`sample_chunks`, default budget
:data:`CHUNK_ELEMENTS`).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Callable, ClassVar

import torch
from torch import Tensor, nn
from gradlens.core.limits import CHUNK_ELEMENTS
from gradlens.core.param_shapes import full_numel

__all__ = ["Kernel", "KINDS", "CHUNK_ELEMENTS", "check_kernel", "qualname", "sample_chunks", "tgram_cheaper", "add_into",
           "joint_sq_norm"]



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


def qualname(cls: type) -> str:
    """``"module.QualName"`` of a class: how a layer registered by name (a library gradlens does
    not import, e.g. ``"transformers.pytorch_utils.Conv1D"``) is matched."""
    return f"{cls.__module__}.{cls.__qualname__}"


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

    What a kernel offers is declared on its class (checked by :func:`check_kernel` when it is
    registered or first handed out by the registry): the maths it implements (:attr:`kind`,
    :attr:`factored`, :attr:`mixes_samples`, :attr:`per_micro_batch`) and the fast paths of the
    capture it supports (:attr:`rows_per_sample`, :attr:`fused_layers`,
    :meth:`routes_param_grads`), as BackPACK's extensions declare the modules they handle;
    :mod:`gradlens.capture` reads them and holds no list of kernel types. Declarations are
    inherited: a subclass whose maths differ from its base's states its own. A kernel must
    define :meth:`per_sample`; everything else has a default."""

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
    #: a use's samples may each hold several rows of the input (the samples the leading factor
    #: of their axis, e.g. ``[B * nW, w * w, C]`` windows of an image): the capture then hands
    #: the kernel ``a [B, f, ...]`` and ``delta [B, f, ...]``, and its maths sum a sample's rows
    #: as positions (Linear, LayerNorm, Embedding). False: such a use is refused (its sample
    #: axis reported as unknown, :meth:`gradlens.capture.tap.Tap.axis_error`)
    rows_per_sample: ClassVar[bool] = False
    #: with :attr:`rows_per_sample`: a sample's rows are handed *last*, ``a [B, ..., f]`` and
    #: ``delta [B, ..., f]`` (the rows one more trailing position), for channel-first layers whose
    #: maths sum the positions after the channel dim (BatchNorm in eval mode on a ``[B * N, C]``
    #: flattening, as LeViT's ``bn(x.flatten(0, 1))``: ``[B, C, N]``)
    rows_last: ClassVar[bool] = False
    #: the layer classes whose sequence calls may run fused with their measurement
    #: (:mod:`gradlens.capture.fused`: one autograd Function whose backward takes dL/dW from the
    #: per-sample weight gradients the Meter formed anyway, not from a second matmul), where the
    #: Meter's plan asks for it (:attr:`gradlens.measure.meter.Plan.fuse_weight_grad`):
    #: qualified class name (``"torch.nn.modules.linear.Linear"``) -> whether the weight is
    #: ``[d_in, d_out]`` (``y = x W + b``, transformers' ``Conv1D``) rather than ``[d_out,
    #: d_in]`` (``F.linear``). Exactly these classes (a subclass's forward may compute something
    #: else); their forward must be that affine map of ``module.weight`` and ``module.bias``
    fused_layers: ClassVar[Mapping[str, bool]] = MappingProxyType({})
    #: the tensor inputs of the layer's call that its maths read (``nn.Bilinear``: 2): the
    #: capture checks each one's sample axis, puts each batch-first and hands the kernel
    #: :meth:`join_inputs` of them as ``a``; a layer of more than one input defines that method
    inputs: ClassVar[int] = 1

    def join_inputs(self, module: nn.Module, inputs: tuple[Tensor, ...]) -> Tensor:
        """The one batch-first tensor ``a`` this kernel's methods receive for a call whose first
        :attr:`inputs` positional arguments are ``inputs`` (each ``[B, ...]``, detached): one
        tensor per use, so that stacking, cross-micro-step pieces and rank merging need not know
        how many inputs a layer has. Default (one input): that input."""
        return inputs[0]

    def routes_param_grads(self, module: nn.Module) -> bool:
        """Whether the autograd node of one call of ``module`` has each of the call's parameters
        as a direct input (``weight.t()`` through its transpose node), so that this node sees
        exactly that call's dL/dp, before other uses, regularisers or DDP add to it: the call is
        one torch operation of its input and parameters. Then a hook there
        (:func:`gradlens.capture.param_grads._hook_param_grads`) gives the call's sum_n g_n (in
        units of the per-sample scale) and the kernel's ``grad_sum`` is not run for them.
        Default False (the kernel's sums are used)."""
        return False

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
        return sample_chunks(sum(full_numel(p) for p in module.parameters(recurse=False)), batch)

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
        return self._reduce(module, a, delta, lambda g: g.reshape(g.shape[0], -1).square().sum(1), cat=True)

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
        return _cat([rows(got[attr]) for attr in attrs], dim=1)

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
_FLAGS = ("factored", "mixes_samples", "per_micro_batch", "rows_per_sample", "rows_last")
_SUMS = ("batch_l2", "sum_grad_squared", "grad_sum")


def _overrides(cls: type, name: str) -> bool:
    return getattr(cls, name) is not getattr(Kernel, name)


def check_kernel(kernel: object) -> None:
    """Check what ``kernel`` declares (:attr:`Kernel.kind`, :attr:`Kernel.factored`,
    :attr:`Kernel.mixes_samples`, :attr:`Kernel.per_micro_batch`, :attr:`Kernel.rows_per_sample`,
    :attr:`Kernel.rows_last`, :attr:`Kernel.fused_layers`, :meth:`Kernel.routes_param_grads`,
    :attr:`Kernel.inputs`) against what it implements;
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
    if kernel.rows_last and not kernel.rows_per_sample:
        raise ValueError(
            f"{name}.rows_last = True but rows_per_sample is False; set rows_per_sample = True (the "
            "kernel takes several rows per sample), or leave rows_last out"
        )
    fused = kernel.fused_layers
    if not isinstance(fused, Mapping) or not all(
            isinstance(k, str) and "." in k and isinstance(v, bool) for k, v in fused.items()):
        raise TypeError(
            f"{name}.fused_layers must map qualified layer class names to whether the weight is "
            f"transposed, got {fused!r}; e.g. fused_layers = {{\"torch.nn.modules.linear.Linear\": "
            "False}, or leave it out (no fused calls)"
        )
    if not callable(kernel.routes_param_grads):
        raise TypeError(
            f"{name}.routes_param_grads must be a method, got {kernel.routes_param_grads!r}; define "
            "routes_param_grads(self, module) -> bool, or leave it out (False)"
        )
    n_in = kernel.inputs
    if not isinstance(n_in, int) or isinstance(n_in, bool) or n_in < 1:
        raise TypeError(f"{name}.inputs must be a positive int (the tensor inputs its maths read), got {n_in!r}")
    if n_in > 1 and not _overrides(cls, "join_inputs"):
        raise TypeError(
            f"{name}.inputs = {n_in} but {name} does not define join_inputs; define "
            "join_inputs(self, module, inputs) -> Tensor (the inputs as one batch-first tensor, "
            "e.g. torch.cat(inputs, dim=-1)), or set inputs = 1"
        )
    if n_in > 1 and kernel.rows_per_sample:
        raise ValueError(
            f"{name}.inputs = {n_in} with rows_per_sample = True: the capture follows several rows "
            "per sample for one-input layers only; set rows_per_sample = False"
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


def rows(g: Tensor) -> Tensor:
    """``[B, D]``: per-sample ``g`` (``[B, *param]``) flattened per sample; a 0-dim parameter's
    ``[B]`` gives ``[B, 1]`` (``flatten(1)`` would fail on it)."""
    return g.reshape(g.shape[0], -1)


def _cat(tensors: list[Tensor], dim: int = 0) -> Tensor:
    """``torch.cat`` without the copy when there is one tensor."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=dim)


def zeros_into(acc: dict, key: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
    """``acc[key]``, created as zeros of ``shape`` (in the buffer the accumulator dict offers
    for ``key``, :class:`gradlens.core.stats.Accumulators`) if missing: a sum that in-place adds
    then build."""
    got = acc.get(key)
    if got is None:
        buffer = getattr(acc, "buffer", None)
        out = buffer(key, shape, like) if buffer else None
        got = acc[key] = like.new_zeros(shape) if out is None else out.zero_()
    return got


def add_into(acc: dict[str, Tensor], key: str, v: Tensor) -> None:
    if key in acc:
        acc[key].add_(v)
    else:
        acc[key] = v


def joint_sq_norm(g: dict[str, Tensor], names) -> Tensor:
    """``[B]`` ||g_n||^2 over the attributes ``names`` of the per-sample gradients ``g``
    (attribute -> ``[B, *param]``), in one pass."""
    flat = [rows(g[attr]) for attr in names]
    return (torch.cat(flat, 1) if len(flat) > 1 else flat[0]).square().sum(1)


def _with_bias_column(x: Tensor, attrs) -> Tensor:
    """``[B, T, d_in (+1)]``: the weight's input factor and, if the bias is tracked, a column of
    ones (the bias as one more input)."""
    cols = []
    if "weight" in attrs:
        cols.append(x)
    if "bias" in attrs:
        cols.append(x.new_ones(x.shape[0], x.shape[1], 1))
    return torch.cat(cols, dim=2) if len(cols) > 1 else cols[0]


def refuse_forward(module: nn.Module, tap, what: str) -> None:
    """Raise for a module whose tracked-window forward (:mod:`gradlens.kernels.attention`,
    :mod:`gradlens.kernels.recurrent`) does not follow ``what`` (one of its settings or input
    kinds); ``tap`` names the module, the message says how to leave its parameters out."""
    name = tap.name_of(module)
    raise NotImplementedError(
        f"gradlens: {type(module).__name__} {name!r} with {what} has no tracked-window forward; "
        f"leave its parameters out: Lens(..., exclude=[{name!r}])"
    )
