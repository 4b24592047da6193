"""Shared machinery of the cross-micro-step instruments (:class:`BatchDot`, :class:`InnerTest`,
:class:`OrthoTest`, :class:`Alpha`): window state, kept factors or sketches, memory budget,
the rank merge, and the sketch map R.

These statistics pair a sample with a vector that does not exist when the sample's micro-step
runs: another micro-step's sample (``g_n . g_m``), the window gradient g (known when the window
closes) or the update d = theta_{t+1} - theta_t (known after the optimizer's real update).
See docs/cross_microstep.md for the design; in short:

**Exact mode** (``mode="exact"``, the default). Each instrument keeps, for every watched layer and
micro-step, the layer input ``a`` ``[B, ...]`` and the per-sample-scaled output gradient
``delta`` ``[B, ...]`` (references to the tensors the capture computed anyway, not copies: the
instruments of one Lens share them). When the window-end vector is known it evaluates

* projections ``<D, g_n>`` for a direction ``D`` of the layer's parameters by *re-running the
  layer's forward along D*: every supported layer is linear in its parameters, so
  ``<D, g_n> = sum(delta_n * layer(a_n; params=D))`` — one forward pass with the parameters
  replaced by D (``F.linear``, ``conv``, the eval BatchNorm affine map); nothing of size
  ``[N, *param]`` is formed (other layers: materialised slices);
* Gram blocks ``g_n . g_m`` from the factor identities of docs/cross_microstep.md: Linear (no sequence axis)
  ``(A A^T + 1[bias]) * (Delta Delta^T)``; Linear with a sequence axis and Conv2d (unfold): sums
  of ``T x T`` products where they cost fewer multiply-adds than materialising
  (:func:`gradlens.kernels.tgram_cheaper`: ``N T^2 (d_in + d_out) < d_in d_out (T + N)``);
  otherwise a sequence Linear materialises its per-sample gradients one block of weight rows at
  a time (bounded memory), and other layers their ``[N, *param]`` once at window end (one layer
  at a time), each reduced with one matmul.

The memory kept is bounded by ``max_bytes`` (default 1 GiB); exceeding it raises a
``RuntimeError`` that names the bounded-memory mode. In sketch mode the same budget bounds the
random matrices (``k * (rows + cols)`` numbers per parameter block, checked before each is drawn,
with the estimate in the message) and the ``[N, k]`` sketches; ``k`` whose smallest possible
matrices alone exceed it (``16 k`` bytes) is refused at construction. Inputs and output gradients are kept by
reference (a slice of a larger tensor, such as a micro-batch from ``x.split``, is copied), so a
tensor modified in place before the window closes is detected (version counter) and refused.

**Sketch mode** (``mode="sketch"``, ``k`` dimensions). Each g_n is reduced to ``s_n = R g_n`` in
``R^k`` as soon as its micro-step runs, and only ``[N, k]`` is kept. Row j of R is, for every
parameter block viewed as a matrix (Linear: ``[d_out, d_in + 1]`` weight with bias column, Conv:
``[C_out, C_in*kh*kw + 1]``, others: ``[shape[0], -1]``), ``vec(u_j v_j^T) / sqrt(k)`` with
independent Rademacher vectors ``u_j``, ``v_j`` per block — so ``s_n`` is computed from the
layer factors (``s_nj = sum_t (u_j . delta_nt)(v_j . [a_nt, 1])``) without materialising g_n.
Every dot product ``x . y`` of sketched vectors is estimated by ``s(x) . s(y)``:

    E[s(x) . s(y)] = x . y,        Var[s(x) . s(y)] <= 8 ||x||^2 ||y||^2 / k,

(proof in docs/cross_microstep.md), for any pair of per-sample gradients, and for a per-sample
gradient and the update direction d or the window gradient g. R is fixed for the lifetime of the
instrument (``seed``), so start and end points of Alpha share it.

Micro-steps are paired use by use through what a use measures, the qualified names of its
parameters (:func:`use_key`), never through its position in the forward: a branch that one
micro-step skips, or a prefix that ``undefined="exclude"`` leaves out after the first micro-step,
moves the later uses' positions. Uses of one key whose maths differ between micro-steps (a
module's factors in one, several uses summed in another) are paired through their materialised
per-sample gradients.

The per-layer maths (projections, Gram pieces, sketches) are methods of the layer's kernel
(:class:`gradlens.kernels.Kernel`); this module keeps and combines what they return.

Record values are float64 on the CPU; ``record.meta[key]`` says which mode produced them.
"""

from __future__ import annotations

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from gradlens.compat import tensor_version
from gradlens.instruments.base import Instrument
from gradlens.core.stats import DistParts, WindowStats
from gradlens.core.state_checks import check_state
from gradlens.core.limits import DEFAULT_MAX_BYTES

__all__ = ["DEFAULT_MAX_BYTES"]



def use_key(w) -> str:
    """What a use of tracked parameters *is*, the same in every micro-step: the qualified names
    of the parameters it measures (``w.params``' values, sorted, joined by ``+``). Within one
    micro-step each tracked parameter is measured at one use (several uses of a parameter are
    summed first), so the key is unique there. A use's ``name`` is not: ``"op<k>:..."`` counts
    the operations of a forward, and a use that one micro-step skips (a branch, a prefix that
    ``undefined="exclude"`` dropped after the first micro-step) shifts the k of the later ones.
    Cross-micro-step blocks pair uses by this key."""
    return "+".join(sorted(w.params.values()))


# =============================================================================== sketches
class _Sketcher:
    """The fixed random map R: per watched layer and parameter block, Rademacher ``u [k, rows]``
    and ``v [k, cols]``, drawn once from ``(seed, layer name)``. ``s(g)_j = u_j^T G v_j / sqrt(k)``
    summed over blocks, with G the block's gradient viewed as a matrix. Which blocks a layer has,
    and how its sketch is computed (from the factors where it can), is the kernel's business
    (:meth:`gradlens.kernels.Kernel.sketch`); the sketcher only holds the random matrices."""

    def __init__(self, k: int, seed: int, max_bytes: int | None = None, owner: str = "BatchDot"):
        self.k, self.seed = k, seed
        self.max_bytes, self.owner = max_bytes, owner  # budget of the cached matrices (None: none)
        self._cache: dict[tuple[str, str, torch.dtype, torch.device], tuple[Tensor, Tensor]] = {}
        self.nbytes = 0  # bytes of the cached matrices

    def _check_room(self, w, block: str, rows: int, cols: int, like: Tensor) -> int:
        """Bytes the pair of ``block`` of layer ``w`` will keep, refused before it is drawn when
        the cached matrices would exceed ``max_bytes`` (the int64 draws are a transient 2x)."""
        need = self.k * (rows + cols) * like.element_size()
        if self.max_bytes is not None and self.nbytes + need > self.max_bytes:
            raise RuntimeError(
                f"{self.owner}(mode='sketch', k={self.k}) needs {_human(need)} for the random sketch "
                f"matrices of layer {w.name!r} ({block}: k x (rows + cols) = {self.k} x "
                f"({rows} + {cols}) numbers of {like.element_size()} bytes, plus a transient "
                f"{_human(self.k * (rows + cols) * 8)} while they are drawn), "
                f"{_human(self.nbytes + need)} with the layers before, over max_bytes={self.max_bytes}; "
                f"use a smaller k (a dot product's error is at most sqrt(8/k) ||x|| ||y||: 9% at "
                f"k=1024), or raise max_bytes"
            )
        return need

    def _pair(self, w, block: str, rows: int, cols: int, like: Tensor) -> tuple[Tensor, Tensor]:
        name = use_key(w)  # the same R for the same parameters in every micro-step
        key = (name, block, like.dtype, like.device)
        if key not in self._cache:
            self.nbytes += self._check_room(w, block, rows, cols, like)
            gen = torch.Generator().manual_seed(
                (self.seed * 1_000_003 + zlib.crc32(f"{name}/{block}".encode())) % (1 << 62)
            )
            u = torch.randint(0, 2, (self.k, rows), generator=gen).mul_(2).sub_(1)
            v = torch.randint(0, 2, (self.k, cols), generator=gen).mul_(2).sub_(1)
            scale = self.k ** -0.5
            self._cache[key] = (
                (u * scale).to(dtype=like.dtype, device=like.device),
                v.to(dtype=like.dtype, device=like.device),
            )
        return self._cache[key]

    def pairs(self, w, like: Tensor):
        """``pair(block, rows, cols) -> (u [k, rows] / sqrt(k), v [k, cols])`` of layer ``w``."""
        return lambda block, rows, cols: self._pair(w, block, rows, cols, like)

    def sketch(self, w, a: Tensor, delta: Tensor) -> Tensor:
        """``[B, k]``: s(g_n) of one layer."""
        return w.kernel.sketch(w.module, a, delta, w.params, self.k, self.pairs(w, delta))

    def sketch_direction(self, w, direction: dict[str, Tensor], like: Tensor) -> Tensor:
        """``[k]``: s(D) of one layer's direction (attribute -> ``[*param]``)."""
        return w.kernel.sketch_direction(w.module, direction, w.params, self.k, self.pairs(w, like), like)


def _own(t: Tensor) -> Tensor:
    """``t`` itself if it owns its storage, else a copy: a slice of a larger tensor (e.g. a
    micro-batch from ``x.split(...)``) shares its version counter with the other slices, so an
    in-place change of a later micro-batch would look like a change of this one."""
    whole = t.numel() * t.element_size()
    if t.storage_offset() == 0 and t.untyped_storage().nbytes() == whole:
        return t
    return t.clone()


# =============================================================================== state
@dataclass
class _Layer:
    w: Any  # gradlens.capture.events.Site
    a: Tensor
    #: the output gradient: in per-sample units, or (``scale`` set) as autograd delivered it
    delta: Tensor
    #: the version counters of ``a`` and ``delta`` when kept (a Lens state writes whether they
    #: were still intact, :mod:`gradlens.lens.state_codec`: a reloaded tensor's counter restarts)
    versions: tuple[int, int]
    #: ``[B, B]`` float64 Gram of this micro-step's samples, formed in backward where a fused
    #: Linear call took its dL/dW from the same blocks (a one-micro-step window uses it as is)
    gram: Tensor | None = None
    #: the micro-step's per-sample scale (float or 0-d tensor) when ``delta`` is kept unscaled
    #: (:attr:`BatchDot.carries_scale`): per-sample units are ``delta * scale``. A Gram is
    #: bilinear in delta, so its block of micro-steps k, l is ``s_k s_l`` times the block of
    #: the unscaled factors (:func:`_scale_blocks`); the ``delta * scale`` copy is formed only
    #: where a path needs the units themselves (:meth:`units`: the rank merge, projections).
    scale: Any = None
    _units: Tensor | None = None

    def units(self) -> Tensor:
        """``[B, ...]``: the output gradient in per-sample units (formed once, if kept unscaled)."""
        if self.scale is None:
            return self.delta
        if self._units is None:
            self._units = self.delta * self.scale
        return self._units


@dataclass
class _Part:
    """One micro-step: what it contributed to the window."""

    batch: int = 0
    layers: dict[str, _Layer] = field(default_factory=dict)
    sketch: Tensor | None = None  # [B, k], sketch mode
    losses: Tensor | None = None  # [B] float64, Alpha
    end_proj: Tensor | None = None  # [B] d_prev . g_n, Alpha
    end_token: int | None = None
    dense_per_sample: int = 0  # bytes per sample of the largest layer materialised at window end


@dataclass
class _DotState:
    """Mergeable window state of the cross-micro-step instruments: the list of micro-step parts
    (merge concatenates: associative, samples stay in order)."""

    parts: list[_Part] = field(default_factory=list)
    reduction: str = "mean"
    params: dict[str, Tensor] = field(default_factory=dict)  # qualified name -> parameter
    modules: dict[str, Any] = field(default_factory=dict)  # layer name -> gradlens.capture.events.Site
    # Alpha, filled around the real update
    theta0: dict[str, Tensor] | None = None
    start: dict[str, Any] | None = None

    @property
    def num_samples(self) -> int:
        return sum(p.batch for p in self.parts)

    def part(self) -> _Part:
        if not self.parts:
            self.parts.append(_Part())
        return self.parts[-1]


_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32)


def _cat_cached(ctx, tensors: list[Tensor]) -> Tensor:
    """``torch.cat(tensors)``, the same object for the same inputs within one merge (so that the
    factors BatchDot / InnerTest / OrthoTest / Alpha share are gathered once)."""
    if len(tensors) == 1:
        return tensors[0]
    cache = ctx.cache
    key = ("cat",) + tuple(id(t) for t in tensors)
    if key not in cache:
        cache[key] = (torch.cat(tensors), tensors)  # keep the inputs alive with the key
    return cache[key][0]


def _times_scale_sq(k: Tensor, scale) -> Tensor:
    """``k * scale^2`` in float64 (``scale``: float or 0-d tensor): a Gram of unscaled factors
    in per-sample units."""
    if isinstance(scale, Tensor):
        return k * scale.detach().to(device=k.device, dtype=torch.float64).square()
    return k * (float(scale) ** 2)


def _scale_blocks(k: Tensor, pieces) -> Tensor:
    """``[n, n]`` float64 Gram ``k`` of ``pieces`` (``(w, a, delta, scale)`` per micro-step,
    samples in order) in per-sample units: ``k_nm s_n s_m`` with ``s_n`` the scale of sample
    n's micro-step (1 where delta is in per-sample units already). No ``delta * scale`` copy."""
    if all(p[3] is None for p in pieces):
        return k
    if len(pieces) == 1:
        return _times_scale_sq(k, pieces[0][3])
    sv = torch.cat([
        torch.as_tensor(1.0 if p[3] is None else p[3], dtype=torch.float64).detach().cpu().reshape(1).expand(p[2].shape[0])
        for p in pieces
    ])
    return k * sv[:, None] * sv[None, :]


def _nbytes(t: Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _human(nbytes: float) -> str:
    """``nbytes`` as a short size (``"24.0 GB"``), decimal units."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{int(nbytes)} bytes"


class _CrossSample(Instrument):
    """Shared machinery: keeps layer factors (exact) or sketches (sketch) of the window's g_n."""

    needs = frozenset({"layer"})

    def __init__(
        self,
        mode: str = "exact",
        *,
        k: int = 1024,
        max_bytes: int = DEFAULT_MAX_BYTES,
        seed: int = 0,
    ):
        if mode not in ("exact", "sketch"):
            raise ValueError(f"mode must be 'exact' or 'sketch', got {mode!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k (sketch dimension) must be a positive int, got {k!r}")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be a non-negative int (bytes), got {max_bytes!r}")
        if mode == "sketch" and 16 * k > max_bytes:  # u, v of the smallest block, as drawn (int64)
            raise ValueError(
                f"{type(self).__name__}(mode='sketch', k={k}) needs at least {_human(16 * k)} for "
                f"its random sketch matrices (k x (rows + cols) numbers per parameter block, "
                f"drawn as int64; k x 8 bytes per sample for the [N, k] sketches), over "
                f"max_bytes={max_bytes}; use a smaller k (e.g. k=1024), or raise max_bytes"
            )
        self.mode, self.k, self.max_bytes, self.seed = mode, k, max_bytes, seed
        self._sketcher = _Sketcher(k, seed, max_bytes, type(self).__name__) if mode == "sketch" else None

    @property
    def mode_name(self) -> str:
        return "exact" if self.mode == "exact" else f"sketch(k={self.k})"

    def __repr__(self) -> str:
        extra = f", k={self.k}" if self.mode == "sketch" else ""
        return f"{type(self).__name__}(mode={self.mode!r}{extra})"

    # ---- capture -----------------------------------------------------------------------
    def start_window(self) -> _DotState:
        return _DotState()

    #: whether :meth:`update_layer` forms the micro-step's Gram in backward for a fused Linear
    #: call (BatchDot, exact mode), handing the call its weight gradient from the same blocks
    gram_in_backward = False

    @property
    def fills_weight_grad(self) -> bool:
        return self.gram_in_backward and self.mode == "exact"

    #: whether :meth:`update_layer` accepts ``delta`` unscaled with its per-sample ``scale``
    #: (the Lens then skips the ``delta * scale`` copy of every use it hands only to this
    #: instrument); BatchDot, exact mode
    carries_scale = False

    def update_layer(self, state: _DotState, module, a: Tensor, delta: Tensor, weight_grad=None,
                     scale=None) -> None:
        """``weight_grad``: ``(WeightGrad, per-sample scale)`` of a fused Linear call not yet
        given its dL/dW (see :attr:`fills_weight_grad`). ``scale`` (only where
        :attr:`carries_scale`): ``delta`` is the output gradient as autograd delivered it, and
        ``delta * scale`` its per-sample units (float or 0-d tensor)."""
        part = state.part()
        key = use_key(module)
        state.modules[key] = module
        for attr, q in module.params.items():
            state.params[q] = getattr(module.module, attr)
        if self._sketcher is not None:
            s = self._sketcher.sketch(module, a, delta if scale is None else delta * scale)
            part.sketch = s if part.sketch is None else part.sketch + s
            return
        a, delta = _own(a), _own(delta)
        lay = part.layers[key] = _Layer(module, a, delta, (tensor_version(a), tensor_version(delta)), scale=scale)
        if weight_grad is not None and self.fills_weight_grad:
            holder, wscale = weight_grad
            k, wsum = module.kernel.gram_with_sum(module.module, a, delta, module.params)
            if wsum is not None:
                if scale is None:  # delta in per-sample units: dL/dW = sum_n g_n / scale
                    lay.gram = k.double().cpu()
                    holder.value = (wsum / wscale).to(module.module.weight.dtype)
                else:  # unscaled delta: its sum is dL/dW itself, the Gram scales by s^2
                    lay.gram = _times_scale_sq(k.double(), scale).cpu()
                    holder.value = wsum.to(module.module.weight.dtype)
        if self._materialises(module, a, delta):
            per = sum(getattr(module.module, attr).numel() for attr in module.params)
            part.dense_per_sample = max(part.dense_per_sample, per * delta.element_size())

    def _materialises(self, module, a: Tensor, delta: Tensor) -> bool:
        """Whether window-end work materialises this layer's ``[N, *param]`` (Gram only)."""
        return False

    def micro_done(self, state: _DotState, batch_size: int, reduction: str, losses) -> None:
        part = state.part()
        part.batch = batch_size
        state.reduction = reduction

    def merge(self, a: _DotState, b: _DotState) -> _DotState:
        out = _DotState(
            parts=a.parts + b.parts,
            reduction=b.reduction if b.parts else a.reduction,
            params={**a.params, **b.params},
            modules={**a.modules, **b.modules},
        )
        self._check_budget(out)
        return out

    def _bytes(self, state: _DotState) -> int:
        n = state.num_samples
        seen: set[int] = set()
        total = 0
        for p in state.parts:
            total += _nbytes(p.sketch) + _nbytes(p.losses) + _nbytes(p.end_proj)
            for lay in p.layers.values():
                for t in (lay.a, lay.delta):
                    if t.data_ptr() not in seen:
                        seen.add(t.data_ptr())
                        total += _nbytes(t)
        total += n * max((p.dense_per_sample for p in state.parts), default=0)
        return total + self._extra_bytes(state)

    def _extra_bytes(self, state: _DotState) -> int:
        return 0

    def _check_budget(self, state: _DotState) -> None:
        used = self._bytes(state)
        if self.mode != "exact":
            kept = self._sketcher.nbytes if self._sketcher is not None else 0
            if used + kept > self.max_bytes:
                raise RuntimeError(
                    f"{type(self).__name__}(mode='sketch', k={self.k}) keeps {_human(used)} of "
                    f"[N, k] sketches for the {state.num_samples} samples of this window so far, "
                    f"plus {_human(kept)} of random matrices, over max_bytes={self.max_bytes}; "
                    "use a smaller k, fewer samples per window, or raise max_bytes"
                )
            return
        if used > self.max_bytes:
            raise RuntimeError(
                f"{type(self).__name__}(mode='exact') needs {used} bytes for the "
                f"{state.num_samples} samples of this window so far (layer inputs and output "
                f"gradients kept until the window closes), over max_bytes={self.max_bytes}; raise "
                f"max_bytes, or use the bounded-memory mode {type(self).__name__}(mode='sketch', "
                f"k=...) which keeps N x k numbers"
            )

    # ---- window-end evaluation ---------------------------------------------------------
    # ---- per parameter group (Lens(groups=...)) ------------------------------------------
    def group_state(self, state: _DotState, names) -> _DotState:
        """Exact mode: the window's layer factors seen through one group: each kept layer
        counts only the group's parameters (a layer whose parameters lie in several groups is
        kept under a new name with the group's part of them, ``"<layer>[weight]"``); the
        factors are the same tensors (no copy), and per-layer Grams of whole layers are shared
        with the totals through the window's memo (:func:`_memo`)."""
        keep = set(names)
        out = _DotState(reduction=state.reduction,
                        params={q: p for q, p in state.params.items() if q in keep})
        for part in state.parts:
            layers = {}
            for name, lay in part.layers.items():
                attrs = [attr for attr, q in lay.w.params.items() if q in keep]
                if len(attrs) == len(lay.w.params):
                    layers[name] = lay
                elif attrs:
                    w = dataclasses.replace(lay.w.only(attrs), name=f"{name}[{','.join(attrs)}]")
                    layers[w.name] = dataclasses.replace(lay, w=w, gram=None)
            out.parts.append(_Part(batch=part.batch, layers=layers))
        return out

    def _check_versions(self, state: _DotState) -> None:
        for p in state.parts:
            for name, lay in p.layers.items():
                if (tensor_version(lay.a), tensor_version(lay.delta)) != lay.versions:
                    raise RuntimeError(
                        f"the input or output gradient of layer {name!r} was modified in place "
                        f"after its micro-step; {type(self).__name__}(mode='exact') keeps them by "
                        "reference until the window closes: do not modify batches in place, or "
                        "use mode='sketch'"
                    )

    def _project(self, state: _DotState, direction: dict[str, Tensor]) -> Tensor:
        """``[N]`` float64: ``<D, g_n>`` over the tracked parameters (exact mode), for
        ``direction`` = qualified parameter name -> ``[*param]``. One layer forward along D per
        layer over all N samples (micro-steps concatenated where their shapes agree)."""
        self._check_versions(state)
        n = state.num_samples
        out = torch.zeros(n, dtype=torch.float64)
        for name, pieces, idx in self._layer_pieces(state):
            w = pieces[0][0]
            dt = pieces[0][2].dtype
            D = {attr: direction[q].to(dt) for attr, q in w.params.items()}
            same = all(p[1].shape[1:] == pieces[0][1].shape[1:] for p in pieces)
            same = same and not w.kernel.per_micro_batch
            if same and len(pieces) > 1 and pieces[0][1].is_floating_point():
                a = torch.cat([p[1] for p in pieces])
                delta = torch.cat([p[2] for p in pieces])
                proj = w.kernel.directional(w.module, a, delta, D, w.params)
            else:
                proj = torch.cat([w.kernel.directional(w.module, p[1], p[2], D, w.params) for p in pieces])
            proj = proj.double().cpu()
            if idx is None:
                out += proj
            else:
                out[idx] += proj
        return out

    def _layer_pieces(self, state: _DotState, raw: bool = False):
        """Per layer: ``(name, [(w, a, delta) per micro-step that reached it], sample index
        or None when every micro-step did)``, delta in per-sample units; ``raw``: pieces
        ``(w, a, delta, scale)`` with delta as kept (``scale`` None: in per-sample units, else
        unscaled, see :class:`_Layer`)."""
        offsets, off = [], 0
        for p in state.parts:
            offsets.append(off)
            off += p.batch
        names: list[str] = []
        for p in state.parts:
            names += [nm for nm in p.layers if nm not in names]
        for name in names:
            lays, idx = [], []
            for p, o in zip(state.parts, offsets):
                if name in p.layers:
                    lays.append(p.layers[name])
                    idx.append(torch.arange(o, o + p.batch))
            where = None if len(lays) == len(state.parts) else torch.cat(idx)
            if not _alike(lays):  # e.g. one use in a micro-step, several (summed) in another
                for q, pieces in _materialised_pieces(lays):
                    yield f"{name}:{q}", [pc + (None,) for pc in pieces] if raw else pieces, where
                continue
            pieces = [(lay.w, lay.a, lay.delta, lay.scale) if raw else (lay.w, lay.a, lay.units()) for lay in lays]
            yield name, pieces, where

    def _sketches(self, state: _DotState) -> Tensor:
        """``[N, k]`` float64 sketches of the window's g_n (sketch mode)."""
        return torch.cat([p.sketch.double().cpu() for p in state.parts])

    def _sketch_direction(self, state: _DotState, direction: dict[str, Tensor]) -> Tensor:
        """``[k]`` float64: s(D) with the same R as the samples."""
        out = torch.zeros(self.k, dtype=torch.float64)
        like = state.parts[0].sketch
        for w in state.modules.values():
            D = {attr: direction[q] for attr, q in w.params.items()}
            out = out + self._sketcher.sketch_direction(w, D, like).double().cpu()
        return out

    def _gram(self, state: _DotState, stats: WindowStats | None = None) -> Tensor:
        """``[N, N]`` float64 g_n . g_m."""
        if self.mode == "sketch":
            S = self._sketches(state)
            return S @ S.T
        self._check_versions(state)
        n = state.num_samples
        K = torch.zeros(n, n, dtype=torch.float64)
        for name, pieces, idx in self._layer_pieces(state, raw=True):
            kl = state.parts[0].layers[name].gram if len(state.parts) == 1 else None
            if kl is None:  # from the factors as kept (unscaled ones: s_k s_l per block)
                kl = _scale_blocks(_memo_layer_gram(stats, [p[:3] for p in pieces]), pieces)
            if idx is None:
                K += kl
            else:
                K[idx[:, None], idx[None, :]] += kl
        return K

    def meta(self, state: _DotState) -> dict[str, Any]:
        return {self.key: self.mode_name}

    # ---- across ranks (gradlens.distributed.merge) ------------------------------------------------
    def to_buffers(self, state: _DotState, ctx):
        """Per rank: its sample count and flags (per-rank row); pieces to gather: the sketches
        ``[N_r, k]`` (sketch mode) or, per watched layer, ``a`` and ``delta`` of all its
        micro-steps concatenated (exact mode), and Alpha's per-sample losses / end projections.
        Factors shared by several instruments are sent once (``ctx.cache``)."""
        parts = state.parts
        n = sum(p.batch for p in parts)
        has_losses = bool(parts) and all(p.losses is not None for p in parts)
        has_end = bool(parts) and all(p.end_proj is not None for p in parts)
        token = parts[0].end_token if parts and parts[0].end_token is not None else -1
        if any(p.end_token != parts[0].end_token for p in parts):
            token = -2  # micro-steps projected on different updates: never settles
        dense = max((p.dense_per_sample for p in parts), default=0)
        row = [float(n), float(has_losses), float(has_end), float(token), float(dense)]
        pieces: list[Tensor] = []
        if self.mode == "sketch":
            k = self.k
            pieces.append(
                torch.cat([p.sketch for p in parts]) if n else torch.zeros(0, k, dtype=torch.float64)
            )
        else:
            self._check_versions(state)
            for w in _watched_uses(ctx):
                key = use_key(w)
                have = [p.layers[key] for p in parts if key in p.layers]
                if not have:
                    row += [-1.0, -1.0]
                    pieces += [torch.zeros(0, dtype=torch.float64)] * 2
                    continue
                if len(have) != len(parts) or any(
                    h.a.shape[1:] != have[0].a.shape[1:] or h.delta.shape[1:] != have[0].delta.shape[1:]
                    for h in have
                ):
                    raise RuntimeError(
                        f"{type(self).__name__}(mode='exact') across ranks needs every micro-step "
                        f"of a rank to reach layer {w.name!r} with the same per-sample shapes; "
                        f"use mode='sketch' (or Lens(..., process_group=False))"
                    )
                a = _cat_cached(ctx, [h.a for h in have])
                d = _cat_cached(ctx, [h.units() for h in have])
                row += [float(_DTYPES.index(a.dtype)), float(_DTYPES.index(d.dtype))]
                pieces += [a, d]
        losses = torch.cat([p.losses for p in parts]) if has_losses else torch.zeros(0, dtype=torch.float64)
        ends = torch.cat([p.end_proj for p in parts]) if has_end else torch.zeros(0, dtype=torch.float64)
        pieces += [losses, ends]
        return DistParts(per_rank=[torch.tensor(row, dtype=torch.float64)], pieces=pieces)

    def from_buffers(self, state: _DotState, ctx, sums, per_rank, pieces) -> _DotState:
        rows = per_rank[0]  # [R, 5 (+ 2 per watched layer in exact mode)]
        world = rows.shape[0]
        out = _DotState(
            reduction=state.reduction,
            params=dict(state.params),
            modules=dict(state.modules),
            theta0=state.theta0,
            start=state.start,
        )
        watched = _watched_uses(ctx)
        for r in range(world):
            n, has_losses, has_end, token, dense = (float(v) for v in rows[r, :5])
            if n <= 0:
                continue
            part = _Part(batch=int(round(n)), dense_per_sample=int(round(dense)))
            part.end_token = None if token == -1 else int(token)
            if has_losses:
                part.losses = pieces[-2][r]
            if has_end:
                part.end_proj = pieces[-1][r]
            if self.mode == "sketch":
                part.sketch = pieces[0][r]
            else:
                for i, w in enumerate(watched):
                    codes = rows[r, 5 + 2 * i : 7 + 2 * i]
                    if float(codes[0]) < 0:
                        continue
                    a = pieces[2 * i][r].to(_DTYPES[int(codes[0])])
                    d = pieces[2 * i + 1][r].to(_DTYPES[int(codes[1])])
                    part.layers[use_key(w)] = _Layer(w, a, d, (tensor_version(a), tensor_version(d)))
                    out.modules[use_key(w)] = w
                    for attr, q in w.params.items():
                        out.params.setdefault(q, getattr(w.module, attr))
            out.parts.append(part)
        self._check_budget(out)
        return out

    # ---- checkpoints (gradlens.lens.state) ----------------------------------------------------
    def state_dict(self) -> dict:
        """The settings that give window states their meaning, checked on load: ``mode``,
        ``k`` and ``seed`` (the sketch's random map is drawn again from them). Nothing else is
        kept between windows (``max_bytes`` is a budget and may change)."""
        return self._settings()

    def load_state_dict(self, state: dict) -> None:
        check_state(self, state, same=self._settings())

    def _settings(self) -> dict:
        return {"mode": self.mode, "k": self.k, "seed": self.seed}


def _watched_uses(ctx) -> list:
    """The window's watched uses (``ctx.watched``, in its order), one per :func:`use_key`."""
    seen: set[str] = set()
    out = []
    for w in ctx.watched:
        key = use_key(w)
        if key not in seen:
            seen.add(key)
            out.append(w)
    return out


def _alike(lays: list[_Layer]) -> bool:
    """Whether the uses of one key in different micro-steps share their maths: the same kernel
    type, the same attribute -> parameter map and inputs of the same rank (what one kernel call
    over all of them assumes)."""
    w0, a0 = lays[0].w, lays[0].a
    return all(
        type(lay.w.kernel) is type(w0.kernel) and lay.w.params == w0.params and lay.a.dim() == a0.dim()
        for lay in lays[1:]
    )


def _materialised_pieces(lays: list[_Layer]):
    """Per parameter q of the key: ``(q, [(site, [B, *param] g_n, zeros [B]) per micro-step])``,
    the per-sample gradients formed from each micro-step's own use (per-sample units), as
    :class:`gradlens.kernels.MaterialisedKernel` pieces (one layer's ``[N, *param]`` at a time)."""
    from gradlens.capture.events import Site
    from gradlens.kernels.materialised import Materialised, MaterialisedKernel

    kernel = MaterialisedKernel()
    for q in sorted(lays[0].w.params.values()):
        pieces = []
        for lay in lays:
            # formed once per layer and kept with it (the window memo keys on tensor ids, which
            # must stay alive while the memo does)
            dense = lay.__dict__.setdefault("_dense", {})
            if q not in dense:
                w, delta = lay.w, lay.units()
                attr = next(at for at, name in w.params.items() if name == q)
                g = w.kernel.per_sample(w.module, lay.a, delta, 0, delta.shape[0], attrs=[attr])[attr]
                site = Site(q, Materialised("p", getattr(w.module, attr)), kernel, {"p": q})
                dense[q] = (site, g, g.new_zeros(g.shape[0]))
            pieces.append(dense[q])
        yield q, pieces


# =============================================================================== window memo
def _memo(stats: WindowStats | None) -> dict:
    """A cache of pure functions of the window's shared layer factors, kept on the window's
    :class:`WindowStats` (the object every instrument's ``finalize`` receives, dropped with the
    window): BatchDot, InnerTest and OrthoTest of one Lens hold the very same ``a``/``delta``
    tensors, so a per-layer Gram or ``g_n . G`` is computed once per window, not once per
    instrument. Keys hold the ids of those tensors (alive while the states hold them)."""
    if stats is None:
        return {}
    memo = getattr(stats, "_gradlens_cross_memo", None)
    if memo is None:
        memo = {}
        stats._gradlens_cross_memo = memo
    return memo


def _pieces_key(pieces) -> tuple:
    return tuple((id(a), id(d), tensor_version(a), tensor_version(d)) for _, a, d in pieces)


def _memo_layer_gram(stats: WindowStats | None, pieces) -> Tensor:
    """``[n, n]`` float64 CPU Gram of one layer (:meth:`gradlens.kernels.Kernel.gram`),
    memoised per window."""
    memo = _memo(stats)
    w = pieces[0][0]
    key = ("gram", w.name, _pieces_key(pieces))
    if key not in memo:
        memo[key] = w.kernel.gram(w.module, [(a, d) for _, a, d in pieces], w.params).double().cpu()
    return memo[key]
