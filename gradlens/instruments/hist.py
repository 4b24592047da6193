"""Histograms of per-sample gradient elements: 1D (g_n,j) and 2D (theta_j, g_n,j).

Binning (both axes): element x falls in bin ``floor((x - lo) * bins / (hi - lo))`` clamped to
``[0, bins - 1]``; values below ``lo`` count in the first bin, values at or above ``hi`` in the
last, and the number clamped is recorded. So ``0`` on a symmetric range with an even number of
bins is counted in the bin right of zero, ``[0, w)``. Non-finite values count as out of range
(-inf low; +inf and NaN high).

Cost: one vectorised pass per layer over slices of samples (``torch.histc`` for 1D, one
``bincount`` over the combined index ``param_bin * grad_bins + grad_bin`` for 2D); no Python loop
over samples or bins. The range is fixed within a window, so micro-step counts add; ``adapt``
sets the next window's range from this window's extremes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from gradlens.instruments.base import Instrument, WindowStats
from gradlens.instruments.outer_hist import bin_of, outer_hist1d, row_extremes
from gradlens.kernels import sample_chunks
from gradlens.records import Hist1d, Hist2d

__all__ = ["GradHist1d", "GradHist2d"]

_ADAPT = (None, "abs_max", "min_max")


def _check_bins(bins, what: str) -> int:
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise ValueError(f"{what} must be a positive int, got {bins!r}")
    return bins


def _check_range(rng, what: str) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in rng)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a pair (lo, hi) of numbers, got {rng!r}") from None
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(f"{what} must satisfy lo < hi (finite), got {rng!r}: the range is empty")
    return lo, hi


def _check_adapt(adapt):
    if adapt not in _ADAPT:
        raise ValueError(f"adapt must be one of {_ADAPT}, got {adapt!r}")
    return adapt


def _edges(lo: float, hi: float, bins: int) -> Tensor:
    """``[bins + 1]`` float64 edges lo + (hi - lo) * i / bins (0 exact on symmetric ranges)."""
    edges = lo + (hi - lo) * torch.arange(bins + 1, dtype=torch.float64) / bins
    edges[-1] = hi
    return edges


def _bin_index(x: Tensor, lo: float, hi: float, bins: int) -> Tensor:
    """int64 bin of every element (the documented floor rule, clamped; NaN -> last bin)."""
    return bin_of(x, lo, hi, bins)


def _pick(fn, a: Tensor | None, b: Tensor | None) -> Tensor | None:
    return b if a is None else a if b is None else fn(a, b.to(a.device))


def _num(t: Tensor | None, default: float) -> float:
    return default if t is None else float(t)


def _adapted(lo_hi: tuple[float, float], mn: float, mx: float, adapt) -> tuple[float, float]:
    if adapt == "abs_max":
        m = max(abs(mn), abs(mx))
        return (-m, m) if math.isfinite(m) and m > 0 else lo_hi
    if adapt == "min_max":
        return (mn, mx) if math.isfinite(mn) and math.isfinite(mx) and mn < mx else lo_hi
    return lo_hi


@dataclass
class _Hist1dState:
    lo: float
    hi: float
    counts: Tensor
    low: Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.int64))
    total: int = 0
    mn: Tensor | None = None  # extremes seen (only with adapt), on the gradients' device
    mx: Tensor | None = None

    def to(self, device) -> None:
        """Keep the counters on the gradients' device (no host sync per slice)."""
        if self.counts.device != device:
            self.counts, self.low = self.counts.to(device), self.low.to(device)


class GradHist1d(Instrument):
    """``record["grad_hist_1d"]``: :class:`~gradlens.records.Hist1d` of every element of every
    per-sample gradient g_n over the tracked parameters (N * D elements per window).

    Args:
        bins: number of bins (default 100, as cockpit-for-pytorch).
        range: ``(lo, hi)`` of the first window (default ``(-2, 2)``).
        adapt: ``None`` (fixed range), ``"abs_max"`` (next range ``(-m, m)``, m the largest
            |g_n,j| of this window) or ``"min_max"`` (next range = this window's extremes).
    """

    key = "grad_hist_1d"
    needs = frozenset({"per_sample"})

    def __init__(self, bins: int = 100, range=(-2.0, 2.0), adapt: str | None = None):
        self.bins = _check_bins(bins, "bins")
        self.range = _check_range(range, "range")
        self.adapt = _check_adapt(adapt)

    def __repr__(self) -> str:
        return f"GradHist1d(bins={self.bins}, range={self.range}, adapt={self.adapt!r})"

    def start_window(self):
        return _Hist1dState(*self.range, torch.zeros(self.bins, dtype=torch.int64))

    def update(self, state: _Hist1dState, name, param, grad_batch):
        x = grad_batch.detach()
        state.to(x.device)
        lo, hi = state.lo, state.hi
        # histc counts in the input dtype: keep each call below 2**24 elements (float32-exact;
        # a precision bound, not a memory chunk)
        for part in x.reshape(-1).split(1 << 24):
            inside = torch.histc(part, self.bins, lo, hi)  # [lo, hi], hi in the last bin
            state.counts += inside.to(torch.int64)
            state.low += (part < lo).sum()
        state.total += x.numel()
        if self.adapt is not None:
            self._extremes(state, x)

    def update_outer(self, state: _Hist1dState, name, param, delta, a) -> bool:
        """Rank-one layers (g_n = delta_n a_n^T, ``delta [B, O]``, ``a [B, I]``): exact counts
        from sorted factors (:mod:`gradlens.instruments.outer_hist`); False if too costly."""
        out = outer_hist1d(delta, a, state.lo, state.hi, self.bins)
        if out is None:
            return False
        state.to(delta.device)
        counts, low, high = out
        state.counts += counts
        # counts include the clamped values; keep the layout of update(): in-range + low
        state.counts[0] -= low
        state.counts[-1] -= high
        state.low += low
        state.total += delta.shape[0] * delta.shape[1] * a.shape[1]
        if self.adapt is not None:
            ext = torch.stack([delta.amin(1) * a.amin(1), delta.amin(1) * a.amax(1),
                               delta.amax(1) * a.amin(1), delta.amax(1) * a.amax(1)])
            self._extremes(state, ext)
        return True

    def update_zeros(self, state: _Hist1dState, name, param, count):
        """``count`` samples whose gradient of ``param`` is exactly zero (a skipped layer)."""
        n = count * param.numel()
        state.to(param.device)
        if 0.0 < state.lo:
            state.low += n
        elif 0.0 <= state.hi:
            zero = torch.zeros(1, dtype=param.dtype if param.is_floating_point() else torch.float32,
                               device=state.counts.device)
            state.counts.index_add_(0, _bin_index(zero, state.lo, state.hi, self.bins),
                                    torch.full((1,), n, dtype=torch.int64, device=zero.device))
        state.total += n  # above hi: counted high (total - in range - low)
        if self.adapt is not None:
            self._extremes(state, torch.zeros(1, device=state.counts.device))

    @staticmethod
    def _extremes(state: _Hist1dState, x: Tensor) -> None:
        mn, mx = torch.aminmax(x)  # kept as tensors: no device sync per slice
        state.mn = mn if state.mn is None else torch.minimum(state.mn, mn)
        state.mx = mx if state.mx is None else torch.maximum(state.mx, mx)

    def merge(self, a: _Hist1dState, b: _Hist1dState) -> _Hist1dState:
        return _Hist1dState(
            a.lo, a.hi, a.counts + b.counts.to(a.counts.device), a.low + b.low.to(a.low.device),
            a.total + b.total, _pick(torch.minimum, a.mn, b.mn), _pick(torch.maximum, a.mx, b.mx),
        )

    def finalize(self, stats: WindowStats, state: _Hist1dState) -> Hist1d:
        counts = state.counts.cpu().clone()
        low = int(state.low)
        high = state.total - int(counts.sum()) - low
        counts[0] += low
        counts[-1] += high
        edges = _edges(state.lo, state.hi, self.bins)
        return Hist1d(counts, edges, low, high)

    def end_window(self, state: _Hist1dState) -> None:
        self.range = _adapted(self.range, _num(state.mn, math.inf), _num(state.mx, -math.inf), self.adapt)

    # ---- across ranks (gradlens.distributed): counts add, extremes are shared per rank ----
    def to_buffers(self, state: _Hist1dState, ctx):
        from gradlens.distributed import DistParts

        sums = [state.counts, state.low, torch.tensor(state.total, dtype=torch.int64)]
        per_rank = [_extremes_row(state.mn, state.mx)] if self.adapt is not None else []
        return DistParts(sums=sums, per_rank=per_rank)

    def from_buffers(self, state: _Hist1dState, ctx, sums, per_rank, pieces) -> _Hist1dState:
        mn, mx = _merged_extremes(per_rank)
        return _Hist1dState(state.lo, state.hi, sums[0], sums[1], int(sums[2]), mn, mx)


@dataclass
class _Hist2dState:
    prange: tuple[float, float]
    grange: tuple[float, float]
    counts: Tensor
    clamped_grad: Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.int64))
    gmn: Tensor | None = None
    gmx: Tensor | None = None
    #: per window (shared by its micro-steps): parameter name -> (theta bin offsets, #theta out
    #: of range, min, max); name + "#rows" -> [O, P] parameter-bin counts per row
    cache: dict = field(default_factory=dict)

    def to(self, device) -> None:
        if self.counts.device != device:
            self.counts, self.clamped_grad = self.counts.to(device), self.clamped_grad.to(device)


class GradHist2d(Instrument):
    """``record["grad_hist_2d"]``: :class:`~gradlens.records.Hist2d`, the joint histogram of
    (theta_j, g_n,j) over all samples n and tracked entries j, theta being the parameter values
    at which the window's gradients were computed.

    Args:
        bins: ``(param_bins, grad_bins)`` or one int for both (default ``(40, 50)``).
        range: ``((p_lo, p_hi), (g_lo, g_hi))`` (default ``((-1, 1), (-2, 2))``).
        adapt: as in :class:`GradHist1d`, applied to both axes.
    """

    key = "grad_hist_2d"
    needs = frozenset({"per_sample"})

    _not_saved = ("_row_cache",)  # a cache (Lens.state_dict leaves it out)

    def __init__(self, bins=(40, 50), range=((-1.0, 1.0), (-2.0, 2.0)), adapt: str | None = None):
        if isinstance(bins, int) and not isinstance(bins, bool):
            bins = (bins, bins)
        try:
            pb, gb = bins
        except (TypeError, ValueError):
            raise ValueError(f"bins must be an int or a pair (param_bins, grad_bins), got {bins!r}") from None
        self.bins = (_check_bins(pb, "bins[0] (parameter bins)"), _check_bins(gb, "bins[1] (gradient bins)"))
        try:
            pr, gr = range
        except (TypeError, ValueError):
            raise ValueError(f"range must be ((p_lo, p_hi), (g_lo, g_hi)), got {range!r}") from None
        self.param_range = _check_range(pr, "range[0] (parameter range)")
        self.grad_range = _check_range(gr, "range[1] (gradient range)")
        self.adapt = _check_adapt(adapt)

    def __repr__(self) -> str:
        return (
            f"GradHist2d(bins={self.bins}, range=({self.param_range}, {self.grad_range}), "
            f"adapt={self.adapt!r})"
        )

    def start_window(self):
        p, g = self.bins
        return _Hist2dState(self.param_range, self.grad_range, torch.zeros(p * g, dtype=torch.int64))

    def start_micro(self, window_state: _Hist2dState) -> _Hist2dState:
        state = self.start_window()
        state.cache = window_state.cache  # theta is fixed within a window: bin it once
        return state

    def _offsets(self, state: _Hist2dState, name: str, param: Tensor) -> Tensor:
        cached = state.cache.get(name)
        if cached is None:
            theta = param.detach()
            lo, hi = state.prange
            off = _bin_index(theta, lo, hi, self.bins[0]).mul_(self.bins[1])
            n_out = int(((theta < lo) | (theta > hi) | theta.isnan()).sum())
            mn, mx = (float(v) for v in torch.aminmax(theta)) if self.adapt else (math.inf, -math.inf)
            cached = state.cache[name] = (off, n_out, mn, mx)
        return cached[0]

    def update(self, state: _Hist2dState, name, param, grad_batch):
        x = grad_batch.detach()
        state.to(x.device)
        off = self._offsets(state, name, param)
        lo, hi = state.grange
        gbins = self.bins[1]
        idx = _bin_index(x, lo, hi, gbins).add_(off)
        state.counts += torch.bincount(idx.reshape(-1), minlength=state.counts.numel())
        state.clamped_grad += ((x < lo) | (x > hi) | x.isnan()).sum()
        if self.adapt is not None:
            self._grad_extremes(state, *torch.aminmax(x))

    def update_outer(self, state: _Hist2dState, name, param, delta, a) -> bool:
        """Rank-one layers (``delta [B, O]``, ``a [B, I]``): a row (n, i) whose products all lie
        in one in-range gradient bin adds row i's parameter-bin counts to that column (one small
        matmul for all such rows); the other rows are binned element by element."""
        pbins, gbins = self.bins
        lo, hi = state.grange
        o, width = param.shape
        state.to(delta.device)
        off = self._offsets(state, name, param)  # [O, I] p_bin * G
        row_counts = self._row_counts(state, name, off)  # [O, P]
        vmin, vmax = row_extremes(delta, a)
        first, last = bin_of(vmin, lo, hi, gbins), bin_of(vmax, lo, hi, gbins)
        single = (first == last) & (vmin >= lo) & (vmax <= hi)
        rows = torch.arange(delta.numel(), device=delta.device)
        row_i = rows % o
        s_rows = rows[single]
        per_col = torch.bincount(row_i[s_rows] * gbins + first[s_rows], minlength=o * gbins)
        joint = row_counts.t().double() @ per_col.view(o, gbins).double()  # [P, G], exact ints
        state.counts += joint.round().long().view(-1)
        multi = rows[~single]
        for s, e in sample_chunks(width, multi.numel()):  # [R, I] products per block
            c = multi[s:e]
            x = delta.reshape(-1)[c, None] * a[c // o]  # the same products, [R, I]
            idx = _bin_index(x, lo, hi, gbins).add_(off[c % o])
            state.counts += torch.bincount(idx.reshape(-1), minlength=state.counts.numel())
            state.clamped_grad += ((x < lo) | (x > hi)).sum()
        if self.adapt is not None:
            self._grad_extremes(state, vmin.min(), vmax.max())
        return True

    def update_zeros(self, state: _Hist2dState, name, param, count):
        """``count`` samples whose gradient of ``param`` is exactly zero (a skipped layer):
        each entry j adds ``count`` to the cell (bin of theta_j, bin of 0)."""
        state.to(param.device)
        off = self._offsets(state, name, param).reshape(-1)
        lo, hi = state.grange
        zero = torch.zeros(1, dtype=param.dtype, device=off.device)
        idx = off + _bin_index(zero, lo, hi, self.bins[1])
        state.counts.index_add_(0, idx, torch.full_like(idx, count))
        if not lo <= 0.0 <= hi:
            state.clamped_grad += count * param.numel()
        if self.adapt is not None:
            z = torch.zeros((), device=off.device)
            self._grad_extremes(state, z, z)

    @staticmethod
    def _grad_extremes(state: _Hist2dState, mn: Tensor, mx: Tensor) -> None:
        state.gmn = mn if state.gmn is None else torch.minimum(state.gmn, mn)
        state.gmx = mx if state.gmx is None else torch.maximum(state.gmx, mx)

    def _row_counts(self, state: _Hist2dState, name: str, off: Tensor) -> Tensor:
        """``[O, P]`` parameter-bin counts of each row of a 2-D parameter (cached per window)."""
        key = name + "#rows"
        cached = state.cache.get(key)
        if cached is None:
            o = off.shape[0]
            pbins, gbins = self.bins
            pb = off // gbins
            ids = torch.arange(o, device=off.device)[:, None] * pbins + pb
            cached = state.cache[key] = torch.bincount(ids.view(-1), minlength=o * pbins).view(o, pbins)
        return cached

    def merge(self, a: _Hist2dState, b: _Hist2dState) -> _Hist2dState:
        return _Hist2dState(
            a.prange, a.grange, a.counts + b.counts.to(a.counts.device),
            a.clamped_grad + b.clamped_grad.to(a.clamped_grad.device),
            _pick(torch.minimum, a.gmn, b.gmn), _pick(torch.maximum, a.gmx, b.gmx),
            cache=a.cache,
        )

    def finalize(self, stats: WindowStats, state: _Hist2dState) -> Hist2d:
        pb, gb = self.bins
        return Hist2d(
            counts=state.counts.view(pb, gb).cpu().clone(),
            param_edges=_edges(*state.prange, pb),
            grad_edges=_edges(*state.grange, gb),
            clamped_param=sum(c[1] for k, c in state.cache.items() if not k.endswith("#rows")) * stats.num_samples,
            clamped_grad=int(state.clamped_grad),
        )

    def end_window(self, state: _Hist2dState) -> None:
        thetas = [c for k, c in state.cache.items() if not k.endswith("#rows")]
        pmn = min((c[2] for c in thetas), default=math.inf)
        pmx = max((c[3] for c in thetas), default=-math.inf)
        self.param_range = _adapted(self.param_range, pmn, pmx, self.adapt)
        self.grad_range = _adapted(
            self.grad_range, _num(state.gmn, math.inf), _num(state.gmx, -math.inf), self.adapt
        )

    # ---- across ranks (gradlens.distributed): counts add, extremes are shared per rank ----
    # (theta is the same on every rank under data parallelism: the parameter side needs nothing)
    def to_buffers(self, state: _Hist2dState, ctx):
        from gradlens.distributed import DistParts

        per_rank = [_extremes_row(state.gmn, state.gmx)] if self.adapt is not None else []
        return DistParts(sums=[state.counts, state.clamped_grad], per_rank=per_rank)

    def from_buffers(self, state: _Hist2dState, ctx, sums, per_rank, pieces) -> _Hist2dState:
        mn, mx = _merged_extremes(per_rank)
        return _Hist2dState(state.prange, state.grange, sums[0], sums[1], mn, mx, cache=state.cache)


def _extremes_row(mn: Tensor | None, mx: Tensor | None) -> Tensor:
    """``[2]`` float64 (min, max) of this rank's window (+inf, -inf when it saw nothing)."""
    lo = torch.tensor(math.inf, dtype=torch.float64) if mn is None else mn.detach().double().cpu()
    hi = torch.tensor(-math.inf, dtype=torch.float64) if mx is None else mx.detach().double().cpu()
    return torch.stack([lo.reshape(()), hi.reshape(())])


def _merged_extremes(per_rank) -> tuple[Tensor | None, Tensor | None]:
    if not per_rank:
        return None, None
    rows = per_rank[0]  # [R, 2]
    return rows[:, 0].min(), rows[:, 1].max()
