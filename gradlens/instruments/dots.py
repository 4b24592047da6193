"""Cross-micro-step dot products: the Gram matrix, search-direction projections, Alpha, and the
inner-product and orthogonality tests.

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
  ``[N, *param]`` is formed;
* Gram blocks ``g_n . g_m`` from the factor identities of DESIGN.md: Linear (no sequence axis)
  ``(A A^T + 1[bias]) * (Delta Delta^T)``; Linear with a sequence axis and Conv2d (unfold) with
  ``2 T^2 <= d_in d_out``: sums of ``T x T`` products; otherwise that layer's ``[N, *param]``
  per-sample gradients are materialised once at window end (one layer at a time) and reduced
  with one matmul.

The memory kept is bounded by ``max_bytes`` (default 1 GiB); exceeding it raises a
``RuntimeError`` that names the bounded-memory mode. Inputs and output gradients are kept by
reference, so a tensor modified in place before the window closes is detected (version counter)
and refused.

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

Record values are float64 on the CPU; ``record.meta[key]`` says which mode produced them.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradlens.instruments.base import Instrument, WindowStats

__all__ = ["BatchDot", "Alpha", "InnerTest", "OrthoTest", "DEFAULT_MAX_BYTES"]

#: default memory budget of one exact-mode instrument (bytes kept for its window)
DEFAULT_MAX_BYTES = 1 << 30
#: elements of one transient block (T x T Gram chunks, materialised slices)
_CHUNK_ELEMENTS = 1 << 22
#: variance used in the Alpha fit where an observed variance is exactly 0 (as in Cockpit)
_VAR_FLOOR = 1e-10


# =============================================================================== layer maths
def _kind(module: nn.Module) -> str:
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return "conv"
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return "bn"
    return "other"


def _matrix_dims(module: nn.Module) -> tuple[int, int] | None:
    """(d_out, d_in) of the weight viewed as a matrix, for Linear and ungrouped Conv."""
    kind = _kind(module)
    if kind == "linear":
        return module.out_features, module.in_features
    if kind == "conv" and module.groups == 1:
        return module.out_channels, module.weight[0].numel()
    return None


def _materialise(w, a: Tensor, delta: Tensor, start: int, stop: int) -> Tensor:
    """``[stop - start, D_layer]`` per-sample gradients of the tracked parameters, flattened in
    ``w.params`` order."""
    got = w.kernel.per_sample(w.module, a, delta, start, stop)
    return torch.cat([got[attr].flatten(1) for attr in w.params], dim=1)


def _sample_chunks(w, batch: int):
    numel = sum(getattr(w.module, attr).numel() for attr in w.params)
    step = max(1, _CHUNK_ELEMENTS // max(numel, 1))
    for s in range(0, batch, step):
        yield s, min(batch, s + step)


def _directional(w, a: Tensor, delta: Tensor, direction: dict[str, Tensor]) -> Tensor:
    """``[B]``: ``<D, g_n>`` for one layer, ``D`` = ``direction`` (attribute -> ``[*param]``).

    The layer's output is linear in its parameters, so ``<D, g_n>`` is ``delta_n`` dotted with
    the layer's output at input ``a_n`` and parameters ``D`` (untracked parameters set to 0).
    Layers without such a formula materialise ``[b, *param]`` slices.
    """
    m, kind = w.module, _kind(w.module)
    b = delta.shape[0]
    dt = delta.dtype
    D = {k: v.to(dt) for k, v in direction.items()}
    out = delta.new_zeros(b)
    if kind == "linear":
        d = delta.reshape(b, -1, delta.shape[-1])
        if "weight" in D:
            x = a.reshape(b, -1, a.shape[-1])
            out = out + (d * F.linear(x, D["weight"])).sum((1, 2))
        if "bias" in D:
            out = out + d.sum(1) @ D["bias"]
        return out
    if kind == "conv":
        if "weight" in D:
            out = out + (delta * m._conv_forward(a, D["weight"], None)).flatten(1).sum(1)
        if "bias" in D:
            out = out + delta.flatten(2).sum(2) @ D["bias"]
        return out
    if kind == "bn":
        shape = [1, -1] + [1] * (a.dim() - 2)
        dims = tuple(range(2, a.dim()))
        if "weight" in D:
            x_hat = (a - m.running_mean.view(shape).to(dt)) / torch.sqrt(
                m.running_var.view(shape).to(dt) + m.eps
            )
            prod = delta * x_hat
            out = out + (prod.sum(dims) if dims else prod) @ D["weight"]
        if "bias" in D:
            out = out + (delta.sum(dims) if dims else delta) @ D["bias"]
        return out
    flat = torch.cat([D[attr].flatten() for attr in w.params])
    parts = [_materialise(w, a, delta, s, e) @ flat for s, e in _sample_chunks(w, b)]
    return torch.cat(parts)


def _seq_factors(w, a: Tensor, delta: Tensor) -> tuple[Tensor, Tensor] | None:
    """``(X [B, T, d_in(+1)], Dl [B, T, d_out])`` with g_n = sum_t Dl_nt X_nt^T (bias as a column
    of ones), for Linear and ungrouped Conv2d; ``None`` for other layers."""
    m, kind = w.module, _kind(w.module)
    b = delta.shape[0]
    if kind == "linear":
        x = a.reshape(b, -1, a.shape[-1])
        d = delta.reshape(b, -1, delta.shape[-1])
    elif isinstance(m, nn.Conv2d) and m.groups == 1:
        x = F.unfold(a, m.kernel_size, m.dilation, m.padding, m.stride).transpose(1, 2)
        d = delta.flatten(2).transpose(1, 2)
    else:
        return None
    cols = []
    if "weight" in w.params:
        cols.append(x)
    if "bias" in w.params:
        cols.append(x.new_ones(x.shape[0], x.shape[1], 1))
    return torch.cat(cols, dim=2) if len(cols) > 1 else cols[0], d


def _positions(w, a: Tensor, delta: Tensor) -> int:
    """T: positions summed in g_n (sequence length, output pixels); 1 for a plain Linear."""
    if _kind(w.module) == "linear":
        return delta[0].numel() // delta.shape[-1]
    return delta[0, 0].numel()


def _use_tgram(w, a: Tensor, delta: Tensor) -> bool:
    dims = _matrix_dims(w.module)
    if dims is None or (_kind(w.module) == "conv" and not isinstance(w.module, nn.Conv2d)):
        return False
    t = _positions(w, a, delta)
    return 2 * t * t <= dims[0] * dims[1]


def _layer_gram(w, pieces: list[tuple[Tensor, Tensor]]) -> Tensor:
    """``[n, n]`` g_n . g_m over one layer's tracked parameters for the samples in ``pieces``
    (list of ``(a, delta)`` per micro-step, concatenated in order)."""
    a0, d0 = pieces[0]
    if _kind(w.module) == "linear" and d0.dim() == 2:
        A = torch.cat([p[0] for p in pieces])
        Dl = torch.cat([p[1] for p in pieces])
        k = Dl @ Dl.T
        if "weight" in w.params:
            ka = A @ A.T
            k = k * (ka + 1) if "bias" in w.params else k * ka
        return k
    if _use_tgram(w, a0, d0):
        facs = [_seq_factors(w, a, d) for a, d in pieces]
        X = torch.cat([f[0] for f in facs])
        Dl = torch.cat([f[1] for f in facs])
        n, t = X.shape[0], X.shape[1]
        X2, D2 = X.reshape(n * t, -1), Dl.reshape(n * t, -1)
        rows = max(1, _CHUNK_ELEMENTS // max(n * t * t, 1))
        out = []
        for s in range(0, n, rows):
            e = min(n, s + rows)
            blk = (X2[s * t : e * t] @ X2.T) * (D2[s * t : e * t] @ D2.T)
            out.append(blk.view(e - s, t, n, t).sum((1, 3)))
        return torch.cat(out)
    G = torch.cat(
        [_materialise(w, a, d, s, e) for a, d in pieces for s, e in _sample_chunks(w, d.shape[0])]
    )
    return G @ G.T


# =============================================================================== sketches
class _Sketcher:
    """The fixed random map R: per watched layer and parameter block, Rademacher ``u [k, rows]``
    and ``v [k, cols]``, drawn once from ``(seed, layer name)``. ``s(g)_j = u_j^T G v_j / sqrt(k)``
    summed over blocks, with G the block's gradient viewed as a matrix."""

    def __init__(self, k: int, seed: int):
        self.k, self.seed = k, seed
        self._cache: dict[tuple[str, str, torch.dtype, torch.device], tuple[Tensor, Tensor]] = {}

    def _pair(self, w, block: str, rows: int, cols: int, like: Tensor) -> tuple[Tensor, Tensor]:
        key = (w.name, block, like.dtype, like.device)
        if key not in self._cache:
            gen = torch.Generator().manual_seed(
                (self.seed * 1_000_003 + zlib.crc32(f"{w.name}/{block}".encode())) % (1 << 62)
            )
            u = torch.randint(0, 2, (self.k, rows), generator=gen).mul_(2).sub_(1)
            v = torch.randint(0, 2, (self.k, cols), generator=gen).mul_(2).sub_(1)
            scale = self.k ** -0.5
            self._cache[key] = (
                (u * scale).to(dtype=like.dtype, device=like.device),
                v.to(dtype=like.dtype, device=like.device),
            )
        return self._cache[key]

    def sketch(self, w, a: Tensor, delta: Tensor) -> Tensor:
        """``[B, k]``: s(g_n) of one layer, from its factors where possible."""
        m = w.module
        b = delta.shape[0]
        dims = _matrix_dims(m)
        if dims is not None:
            d_out, d_in = dims
            u, v = self._pair(w, "wb", d_out, d_in + 1, delta)
            vw, vb = v[:, :d_in], v[:, d_in]
            t = _positions(w, a, delta)
            # per sample: factor route T k (d_in + d_out); materialising route (form g_n, then
            # u^T G v) T d_in d_out + k d_in d_out. Same numbers, cheaper route.
            if t * self.k * (d_in + d_out) > (t + self.k) * d_in * d_out:
                return self._sketch_materialised(w, a, delta, u, vw, vb, d_out, d_in)
            if _kind(m) == "linear":
                ud = delta.reshape(b, -1, d_out) @ u.T  # [B, T, k]
                va = 0
                if "weight" in w.params:
                    va = a.reshape(b, -1, d_in) @ vw.T
                if "bias" in w.params:
                    va = va + vb
                return (ud * va).sum(1)
            ud = torch.einsum("kc,bct->bkt", u, delta.flatten(2))
            va = 0
            if "weight" in w.params:
                va = m._conv_forward(a, vw.reshape(-1, *m.weight.shape[1:]), None).flatten(2)
            if "bias" in w.params:
                va = va + vb[None, :, None]
            return (ud * va).sum(2)
        out = []
        for s, e in _sample_chunks(w, b):
            got = w.kernel.per_sample(m, a, delta, s, e)
            acc = delta.new_zeros(e - s, self.k)
            for attr in w.params:
                g = got[attr].reshape(e - s, got[attr].shape[1] if got[attr].dim() > 1 else 1, -1)
                u, v = self._pair(w, attr, g.shape[1], g.shape[2], delta)
                acc = acc + ((g @ v.T) * u.T).sum(1)
            out.append(acc)
        return torch.cat(out)

    def _sketch_materialised(self, w, a, delta, u, vw, vb, d_out: int, d_in: int) -> Tensor:
        out = []
        for s, e in _sample_chunks(w, delta.shape[0]):
            got = w.kernel.per_sample(w.module, a, delta, s, e)
            acc = delta.new_zeros(e - s, self.k)
            if "weight" in w.params:
                acc = acc + ((u @ got["weight"].reshape(e - s, d_out, d_in)) * vw).sum(2)
            if "bias" in w.params:
                acc = acc + (got["bias"] @ u.T) * vb
            out.append(acc)
        return torch.cat(out)

    def sketch_direction(self, w, direction: dict[str, Tensor], like: Tensor) -> Tensor:
        """``[k]``: s(D) of one layer's direction (attribute -> ``[*param]``)."""
        m = w.module
        D = {k: v.to(like.dtype) for k, v in direction.items()}
        dims = _matrix_dims(m)
        if dims is not None:
            d_out, d_in = dims
            u, v = self._pair(w, "wb", d_out, d_in + 1, like)
            out = like.new_zeros(self.k)
            if "weight" in D:
                out = out + ((u @ D["weight"].reshape(d_out, d_in)) * v[:, :d_in]).sum(1)
            if "bias" in D:
                out = out + (u @ D["bias"]) * v[:, d_in]
            return out
        out = like.new_zeros(self.k)
        for attr in w.params:
            p = D[attr]
            mat = p.reshape(p.shape[0] if p.dim() > 0 else 1, -1)
            u, v = self._pair(w, attr, mat.shape[0], mat.shape[1], like)
            out = out + ((u @ mat) * v).sum(1)
        return out


# =============================================================================== state
@dataclass
class _Layer:
    w: Any  # WatchedModule
    a: Tensor
    delta: Tensor
    versions: tuple[int, int]

    def __getstate__(self) -> dict:  # Lens.state_dict: a reloaded tensor's version restarts
        state = dict(self.__dict__)
        state["versions"] = (self.a._version, self.delta._version) == self.versions
        return state

    def __setstate__(self, state: dict) -> None:
        intact = state.pop("versions")
        self.__dict__.update(state)
        self.versions = (self.a._version, self.delta._version) if intact else (-1, -1)


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
    modules: dict[str, Any] = field(default_factory=dict)  # layer name -> WatchedModule
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


def _nbytes(t: Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class _CrossSample(Instrument):
    """Shared machinery: keeps layer factors (exact) or sketches (sketch) of the window's g_n."""

    needs = frozenset({"layer"})

    _not_saved = ("_sketcher",)  # rebuilt from (k, seed) (Lens.state_dict leaves it out)

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
        self.mode, self.k, self.max_bytes, self.seed = mode, k, max_bytes, seed
        self._sketcher = _Sketcher(k, seed) if mode == "sketch" else None

    @property
    def mode_name(self) -> str:
        return "exact" if self.mode == "exact" else f"sketch(k={self.k})"

    def __repr__(self) -> str:
        extra = f", k={self.k}" if self.mode == "sketch" else ""
        return f"{type(self).__name__}(mode={self.mode!r}{extra})"

    # ---- capture -----------------------------------------------------------------------
    def start_window(self) -> _DotState:
        return _DotState()

    def update_layer(self, state: _DotState, module, a: Tensor, delta: Tensor) -> None:
        part = state.part()
        state.modules[module.name] = module
        for attr, q in module.params.items():
            state.params[q] = getattr(module.module, attr)
        if self._sketcher is not None:
            s = self._sketcher.sketch(module, a, delta)
            part.sketch = s if part.sketch is None else part.sketch + s
            return
        part.layers[module.name] = _Layer(module, a, delta, (a._version, delta._version))
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
        if self.mode != "exact":
            return
        used = self._bytes(state)
        if used > self.max_bytes:
            raise RuntimeError(
                f"{type(self).__name__}(mode='exact') needs {used} bytes for the "
                f"{state.num_samples} samples of this window so far (layer inputs and output "
                f"gradients kept until the window closes), over max_bytes={self.max_bytes}; raise "
                f"max_bytes, or use the bounded-memory mode {type(self).__name__}(mode='sketch', "
                f"k=...) which keeps N x k numbers"
            )

    # ---- window-end evaluation ---------------------------------------------------------
    def _check_versions(self, state: _DotState) -> None:
        for p in state.parts:
            for name, lay in p.layers.items():
                if (lay.a._version, lay.delta._version) != lay.versions:
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
            if same and len(pieces) > 1 and pieces[0][1].is_floating_point():
                a = torch.cat([p[1] for p in pieces])
                delta = torch.cat([p[2] for p in pieces])
                proj = _directional(w, a, delta, D)
            else:
                proj = torch.cat([_directional(w, p[1], p[2], D) for p in pieces])
            proj = proj.double().cpu()
            if idx is None:
                out += proj
            else:
                out[idx] += proj
        return out

    def _layer_pieces(self, state: _DotState):
        """Per layer: ``(name, [(w, a, delta) per micro-step that reached it], sample index
        or None when every micro-step did)``."""
        offsets, off = [], 0
        for p in state.parts:
            offsets.append(off)
            off += p.batch
        names: list[str] = []
        for p in state.parts:
            names += [nm for nm in p.layers if nm not in names]
        for name in names:
            pieces, idx = [], []
            for p, o in zip(state.parts, offsets):
                if name in p.layers:
                    lay = p.layers[name]
                    pieces.append((lay.w, lay.a, lay.delta))
                    idx.append(torch.arange(o, o + p.batch))
            yield name, pieces, (None if len(pieces) == len(state.parts) else torch.cat(idx))

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
        for name, pieces, idx in self._layer_pieces(state):
            kl = _memo_layer_gram(stats, pieces)
            if idx is None:
                K += kl
            else:
                K[idx[:, None], idx[None, :]] += kl
        return K

    def meta(self, state: _DotState) -> dict[str, Any]:
        return {self.key: self.mode_name}


# =============================================================================== instruments
class BatchDot(_CrossSample):
    """``record["batch_dot"]``: Tensor ``[N, N]`` float64, ``g_n . g_m`` over the tracked
    parameters for every pair of samples of the window (rows in the order the samples were seen;
    micro-steps concatenate, cross-micro-step blocks included).

    Exact mode keeps each layer's input and output gradient for the window (bounded by
    ``max_bytes``) and forms the Gram from the factor identities at window end. Sketch mode keeps
    ``[N, k]`` sketches; each entry is then unbiased with standard deviation at most
    ``sqrt(8 / k) ||g_n|| ||g_m||``. ``record.meta["batch_dot"]`` is ``"exact"`` or
    ``"sketch(k=...)"``.

    Args:
        mode: ``"exact"`` (default) or ``"sketch"``.
        k: sketch dimension (sketch mode).
        max_bytes: memory budget of exact mode, bytes kept for the window (default 1 GiB);
            exceeding it raises ``RuntimeError``.
        seed: seed of the sketch.
    """

    key = "batch_dot"

    def _materialises(self, module, a, delta):
        if _kind(module.module) == "linear" and delta.dim() == 2:
            return False
        return not _use_tgram(module, a, delta)

    def finalize(self, stats: WindowStats, state: _DotState) -> Tensor:
        return self._gram(state, stats)


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
    return tuple((id(a), id(d), a._version, d._version) for _, a, d in pieces)


def _memo_layer_gram(stats: WindowStats | None, pieces) -> Tensor:
    """``[n, n]`` float64 CPU Gram of one layer (see :func:`_layer_gram`), memoised per window."""
    memo = _memo(stats)
    key = ("gram", pieces[0][0].name, _pieces_key(pieces))
    if key not in memo:
        memo[key] = _layer_gram(pieces[0][0], [(a, d) for _, a, d in pieces]).double().cpu()
    return memo[key]


def _mean_projections(inst: _CrossSample, stats: WindowStats, state: _DotState) -> tuple[Tensor, float]:
    """Memoised :func:`_mean_projections_uncached` (exact mode: shared by InnerTest/OrthoTest;
    sketch mode: each instrument has its own sketch)."""
    if inst.mode == "sketch":
        return _mean_projections_uncached(inst, stats, state)
    memo = _memo(stats)
    key = ("mean_proj",) + tuple((nm, _pieces_key(pc)) for nm, pc, _ in inst._layer_pieces(state))
    if key not in memo:
        memo[key] = _mean_projections_uncached(inst, stats, state)
    return memo[key]


def _mean_projections_uncached(
    inst: _CrossSample, stats: WindowStats, state: _DotState
) -> tuple[Tensor, float]:
    """``([N] g_n . G, ||G||^2)`` for G = (1/N) sum_n g_n, the window's mean per-sample gradient.

    Exact mode, per layer, whichever is cheaper: the Gram route ``g_n . G = (1/N) sum_m
    K_nm`` (plain Linear layers with ``N (d_in + d_out) < d_in d_out``; then
    ``||G_l||^2 = sum_nm K_nm / N^2``), or the layer's G_l from its factors (the kernel's
    ``grad_sum`` over the window) and a forward along G_l. Sketch mode: ``s_n . mean_m s_m``
    (unbiased) and the exact ``||G||^2`` of the capture's ``grad_sum``.
    """
    n = state.num_samples
    if inst.mode == "sketch":
        S = inst._sketches(state)
        return S @ S.mean(0), float(stats.mean_grad_sq_norm())
    inst._check_versions(state)
    proj = torch.zeros(n, dtype=torch.float64)
    g2 = 0.0
    for name, pieces, idx in inst._layer_pieces(state):
        w, a0, d0 = pieces[0]
        dims = _matrix_dims(w.module)
        if (
            _kind(w.module) == "linear" and d0.dim() == 2 and dims is not None
            and n * (dims[0] + dims[1]) < dims[0] * dims[1]
        ):
            k = _memo_layer_gram(stats, pieces)
            p = k.sum(1) / n
            g2 += float(k.sum()) / (n * n)
        else:
            same = all(pc[1].shape[1:] == a0.shape[1:] for pc in pieces)
            if same and a0.is_floating_point():
                groups = [(torch.cat([pc[1] for pc in pieces]), torch.cat([pc[2] for pc in pieces]))]
            else:
                groups = [(pc[1], pc[2]) for pc in pieces]
            G: dict[str, Tensor] = {}
            for a, d in groups:
                for attr, v in w.kernel.grad_sum(w.module, a, d).items():
                    if attr in w.params:
                        G[attr] = G[attr] + v if attr in G else v
            G = {attr: v / n for attr, v in G.items()}
            g2 += float(sum(torch.sum(v.double().square()) for v in G.values()))
            p = torch.cat([_directional(w, a, d, G) for a, d in groups]).double().cpu()
        if idx is None:
            proj += p.cpu()
        else:
            proj[idx] += p.cpu()
    return proj, g2


class _MeanTest(_CrossSample):
    def __init__(self, mode: str = "exact", **kwargs):
        super().__init__(mode, **kwargs)
        if mode == "sketch":  # the exact ||G||^2 comes from the capture's grad_sum
            self.needs = type(self).needs | {"grad_sum"}


class InnerTest(_MeanTest):
    """``record["inner_test"]``: float, the inner-product test of Bollapragada, Byrd & Nocedal
    (2018, eq. 2.6) as in Cockpit — the smallest theta for which it passes this window:

        inner_test = sqrt( Var_n(g_n . G) / N ) / ||G||^2,

    with G = (1/N) sum_n g_n the window's mean per-sample gradient (also under a "sum" loss: the
    test is about the mean), ``Var_n`` the unbiased sample variance over the N samples of all
    micro-steps. ``g_n . G`` couples samples of different micro-steps, so the window keeps the
    layer factors (exact) or sketches (sketch: ``g_n . G`` estimated by ``s_n . mean_m s_m``,
    unbiased; ``||G||^2`` exact; the test value itself is then approximate). NaN if N < 2 or
    G = 0.
    """

    key = "inner_test"
    needs = frozenset({"layer"})

    def finalize(self, stats: WindowStats, state: _DotState) -> float:
        n = stats.num_samples
        if n < 2:
            return math.nan
        p, g2 = _mean_projections(self, stats, state)
        return math.sqrt(float(p.var()) / n) / g2 if g2 > 0 else math.nan


class OrthoTest(_MeanTest):
    """``record["ortho_test"]``: float, the orthogonality test of Bollapragada, Byrd & Nocedal
    (2018, eq. 3.3) as in Cockpit — the smallest nu for which it passes this window:

        ortho_test = sqrt( V / (N ||G||^2) ),
        V = 1/(N-1) sum_n || g_n - (g_n . G / ||G||^2) G ||^2
          = 1/(N-1) ( sum_n ||g_n||^2 - sum_n (g_n . G)^2 / ||G||^2 ),

    with G = (1/N) sum_n g_n the window's mean per-sample gradient. ``||g_n||^2`` comes from the
    capture (``batch_l2``, factor identities) and ``||G||^2`` is exact; ``g_n . G`` as in
    :class:`InnerTest` (exact or sketched). NaN if N < 2 or G = 0.
    """

    key = "ortho_test"
    needs = frozenset({"layer", "batch_l2"})

    def finalize(self, stats: WindowStats, state: _DotState) -> float:
        n = stats.num_samples
        if n < 2:
            return math.nan
        p, g2 = _mean_projections(self, stats, state)
        if g2 <= 0:
            return math.nan
        v = (float(stats.batch_l2_all().double().sum()) - float(p.square().sum()) / g2) / (n - 1)
        return math.sqrt(max(v, 0.0) / (n * g2))


# =============================================================================== Alpha
def alpha_fit(
    step_len: float, fs: tuple[float, float], dfs: tuple[float, float],
    var_fs: tuple[float, float], var_dfs: tuple[float, float],
) -> tuple[float | None, str]:
    """The noise-informed quadratic fit of Mahsereci & Hennig (2017) / Cockpit along the update.

    The line is parametrised by the distance ``s`` along d / ||d||, start at 0, end at
    ``step_len = ||d||``. Observations ``f(0), f(step_len), f'(0), f'(step_len)`` (mean losses
    and mean directional derivatives ``mean_n(d . g_n) / ||d||``) with variances ``var_*`` (zeros
    replaced by 1e-10, as in Cockpit) give the weighted least-squares quadratic
    ``q(s) = mu0 + mu1 s + mu2 s^2``; with ``s_min = -mu1 / (2 mu2)``,

        alpha = step_len / s_min - 1   (= 2 step_len / (-mu1 / mu2) - 1),

    so 0 means the step landed at the fit's minimum, -1 that it stayed at the start, 1 that it
    went twice as far. A fit without a minimum (``mu2 <= 0``) gives -1 (as in Cockpit).

    Returns:
        ``(alpha, note)``; ``alpha`` is None if the fit is singular.
    """
    t = float(step_len)
    phi = torch.tensor(
        [[1.0, 0.0, 0.0], [1.0, t, t * t], [0.0, 1.0, 0.0], [0.0, 1.0, 2.0 * t]], dtype=torch.float64
    )
    y = torch.tensor([fs[0], fs[1], dfs[0], dfs[1]], dtype=torch.float64)
    var = torch.tensor([*var_fs, *var_dfs], dtype=torch.float64)
    var = torch.where(var == 0, torch.full_like(var, _VAR_FLOOR), var)
    w = 1.0 / var
    lhs = phi.T @ (w[:, None] * phi)
    rhs = phi.T @ (w * y)
    try:
        mu = torch.linalg.solve(lhs, rhs)
    except RuntimeError:
        return None, "singular quadratic fit"
    mu1, mu2 = float(mu[1]), float(mu[2])
    if mu2 <= 0:
        return -1.0, "the fit has no minimum along d (concave or linear): alpha = -1 as in Cockpit"
    if mu1 == 0:
        return math.inf, "the fit's minimum is at the start point"
    return 2.0 * t * mu2 / (-mu1) - 1.0, ""


class Alpha(_CrossSample):
    """``record["alpha"]``: the local effective step length of Mahsereci & Hennig (2017) as in
    Cockpit (Schneider et al. 2021), for the update the optimizer actually made,
    d = theta_{t+1} - theta_t over the tracked parameters (any optimizer, momentum, Adam,
    clipping, accumulation), and ``record["search_dir_projections"]``.

    Start point: this window's samples at theta_t; end point: the *next* window's samples at
    theta_{t+1}. Observations (see :func:`alpha_fit`):

    * ``f(0)``, ``f(1)``: mean of the per-sample losses (``lens.capture(losses=...)``, ``[B_k]``
      per micro-step) of each window, with variance ``Var_n(loss_n) / N`` (unbiased);
    * ``f'(0)``, ``f'(1)``: mean over samples of ``d . g_n / ||d||`` of each window, with variance
      ``Var_n(d . g_n / ||d||) / N``.

    (Cockpit uses ``Var_n`` without ``/ N``; the fit is invariant to a common factor, so the two
    agree whenever both windows have the same N.) Under a "sum" loss the fit uses the same
    per-sample means: alpha is a property of the line, not of the loss scale.

    ``record["search_dir_projections"]``: dict ``{"start": [N_t] d . g_n / ||d||^2 (this window),
    "end": [N_{t+1}] d . g'_n / ||d||^2 (next window, at theta_{t+1}), "update_sq_norm": ||d||^2}``
    (float64).

    **When the record appears.** Alpha of window t needs window t+1, so the Lens keeps record t
    *pending*: it is in ``lens.records`` at once with ``record["alpha"] = None`` and
    ``record.meta["alpha"] = "pending: ..."``; when window t+1 closes, the values are filled in
    and the record is written to the sinks (JSONL, TensorBoard). If window t+1 is not tracked
    (``every``; Alpha needs two consecutive tracked windows, e.g.
    ``every=lambda s: s % 10 in (0, 1)``), captures nothing, or the Lens is closed first,
    ``record["alpha"]`` stays None and ``record.meta["alpha"]`` says why; likewise if no update
    closed window t (``lens.flush()``, or an optimizer step skipped by a GradScaler), if the
    parameters did not change (d = 0), if per-sample losses were not given, or if N < 2.

    **Memory.** The end-point projections onto d (known by then) are computed during the next
    window's backward passes, exactly, from the layer factors, without storage. The start point
    needs this window's g_n after the update: exact mode keeps the layer factors (and theta_t,
    to form d) within ``max_bytes``; sketch mode keeps ``[N, k]`` sketches and estimates
    ``d . g_n`` by ``s(d) . s(g_n)`` (unbiased, standard deviation <= sqrt(8/k) ||d|| ||g_n||).
    ``record.meta["search_dir_projections"]`` says which.
    """

    key = "alpha"

    def __init__(self, mode: str = "exact", **kwargs):
        super().__init__(mode, **kwargs)
        self._direction: dict[str, Any] | None = None  # the last update, for the next window
        self._token = 0

    # ---- capture: end-point projections onto the previous update --------------------------
    def update_layer(self, state: _DotState, module, a: Tensor, delta: Tensor) -> None:
        super().update_layer(state, module, a, delta)
        direction = self._direction
        if direction is None:
            return
        part = state.part()
        D = {attr: direction["d"][q] for attr, q in module.params.items() if q in direction["d"]}
        if not D:
            return
        proj = _directional(module, a, delta, D).double().cpu()
        part.end_proj = proj if part.end_proj is None else part.end_proj + proj
        part.end_token = direction["token"]

    def micro_done(self, state: _DotState, batch_size: int, reduction: str, losses) -> None:
        super().micro_done(state, batch_size, reduction, losses)
        if losses is not None:
            if not isinstance(losses, Tensor) or losses.numel() != batch_size:
                shape = tuple(losses.shape) if isinstance(losses, Tensor) else type(losses).__name__
                raise ValueError(
                    f"lens.capture(losses=...) must be the per-sample losses of this micro-step, "
                    f"a tensor of {batch_size} elements, got {shape}; compute them with "
                    "reduction='none' (e.g. F.cross_entropy(out, y, reduction='none'))"
                )
            state.part().losses = losses.detach().reshape(-1).double().cpu()

    def _extra_bytes(self, state: _DotState) -> int:
        return sum(_nbytes(p) for p in state.params.values())  # theta_t snapshot

    # ---- around the real update -----------------------------------------------------------
    def before_update(self, state: _DotState) -> None:
        state.theta0 = {q: p.detach().clone() for q, p in state.params.items()}

    def after_update(self, state: _DotState) -> None:
        if state.theta0 is None or not state.parts:
            return
        # theta_{t+1} - theta_t in the parameters' dtype (exact for nearby floats, Sterbenz)
        # formed in place in the snapshot's memory (no new D-sized allocation)
        d = {q: torch.sub(p.detach(), state.theta0[q], out=state.theta0[q]) for q, p in state.params.items()}
        state.theta0 = None
        sq = float(sum(torch.dot(v.flatten(), v.flatten()).double() for v in d.values()))
        self._token += 1
        start: dict[str, Any] = {"token": self._token, "sq_norm": sq}
        if sq > 0:
            if self.mode == "sketch":
                proj = self._sketches(state) @ self._sketch_direction(state, d)
            else:
                proj = self._project(state, d)
            start["proj"] = proj
            start["losses"] = (
                torch.cat([p.losses for p in state.parts])
                if all(p.losses is not None for p in state.parts)
                else None
            )
            self._direction = {"token": self._token, "d": d}
        else:
            self._direction = None
        for p in state.parts:  # factors are not needed any more
            p.layers = {}
            p.sketch = None
        state.start = start

    # ---- record ---------------------------------------------------------------------------
    def finalize(self, stats: WindowStats, state: _DotState) -> None:
        return None

    def defers(self, state: _DotState) -> bool:
        return state.start is not None and state.start["sq_norm"] > 0

    def meta(self, state: _DotState) -> dict[str, Any]:
        if state.start is None:
            return {
                "alpha": "missing: no optimizer update closed this window (lens.flush() without "
                "an optimizer step, e.g. after a step skipped by a GradScaler, or no optimizer "
                "given to the Lens)"
            }
        if state.start["sq_norm"] == 0:
            return {"alpha": "missing: the update was zero (parameters unchanged: skipped step?)"}
        return {"alpha": "pending: needs the next window (its gradients at theta_{t+1})"}

    def settle(self, record, state: _DotState, next_state: _DotState | None, reason) -> None:
        start = state.start
        token = start["token"]
        if self._direction is not None and self._direction["token"] == token:
            self._direction = None  # consumed (or stale: the next window was not captured)
        sq = start["sq_norm"]
        proj_meta = f"start: {self.mode_name}, end: exact"
        proj = {"start": start["proj"] / sq, "update_sq_norm": sq}
        record.values["search_dir_projections"] = proj
        record.meta["search_dir_projections"] = proj_meta
        if next_state is None:
            record.meta["alpha"] = f"missing: {reason}"
            return
        if not next_state.parts or any(p.end_token != token for p in next_state.parts):
            record.meta["alpha"] = (
                "missing: the next window's gradients were not projected on this update"
            )
            return
        end = torch.cat([p.end_proj for p in next_state.parts])
        proj["end"] = end / sq
        losses_end = (
            torch.cat([p.losses for p in next_state.parts])
            if all(p.losses is not None for p in next_state.parts)
            else None
        )
        if start["losses"] is None or losses_end is None:
            record.meta["alpha"] = (
                "missing: per-sample losses were not given; pass "
                "lens.capture(losses=per_sample_losses) in this window and the next"
            )
            return
        n0, n1 = start["proj"].numel(), end.numel()
        if n0 < 2 or n1 < 2:
            record.meta["alpha"] = f"missing: variances need N >= 2 samples (got {n0} and {n1})"
            return
        norm = math.sqrt(sq)
        df0, df1 = start["proj"] / norm, end / norm
        value, note = alpha_fit(
            norm,
            (float(start["losses"].mean()), float(losses_end.mean())),
            (float(df0.mean()), float(df1.mean())),
            (float(start["losses"].var()) / n0, float(losses_end.var()) / n1),
            (float(df0.var()) / n0, float(df1.var()) / n1),
        )
        record.values["alpha"] = value
        record.meta["alpha"] = self.mode_name if value is not None else f"missing: {note}"
        if note and value is not None:
            record.meta["alpha_note"] = note
