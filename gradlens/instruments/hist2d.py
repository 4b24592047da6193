"""2D histograms of per-sample gradient elements against their parameter's value:
:class:`GradHist2d` (theta_j, g_n,j), exact or sampled; the shared rule of every histogram
(ranges, adaptation, checks, grouped states) is in :mod:`gradlens.instruments.hist`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from gradlens.core.records import Hist2d
from gradlens.core.state_checks import COUNT, RANGE, check_state
from gradlens.core.stats import DistParts, WindowStats
from gradlens.core.sync import device_paths
from gradlens.core.param_shapes import full_numel
from gradlens.kernels.base import sample_chunks
from gradlens.instruments import native_bins
from gradlens.instruments.binning import _affine, bin_of, count_2d, tally
from gradlens.instruments.hist import (
    _GroupedHist, _adapted, _check_adapt, _check_bins, _check_range, _check_size, _edges,
    _extremes_row, _merged_extremes, _num, _pick, _sampled_counters,
)
from gradlens.instruments.outer_hist import row_extremes
from gradlens.instruments.sampling import Draws, Stratum, check_sample, estimate, merge_strata

__all__ = ["GradHist2d"]


@dataclass
class _Theta:
    """One parameter's bins for a window (theta is fixed within it): computed on its first
    use, kept on the device (no host read until the window closes)."""

    offsets: Tensor | None  # [*param] int32: param_bin * grad_bins (None: not needed yet)
    clamped: Tensor  # 0-d int64: entries outside the parameter range (or NaN)
    mn: Tensor  # 0-d: extremes of theta (for adapt)
    mx: Tensor
    rows: Tensor | None = None  # [O, P] parameter-bin counts per row (2-D parameters, CPU)
    dense: dict = field(default_factory=dict)  # dtype -> [*param] param_bin * (G + 2) (count_2d)

    def dense_offsets(self, dtype: torch.dtype, gbins: int) -> Tensor:
        """``[*param]`` ``param_bin * (gbins + 2)`` in ``dtype`` (for :func:`count_2d`), once
        per window."""
        got = self.dense.get(dtype)
        if got is None:
            got = self.dense[dtype] = (self.offsets // gbins * (gbins + 2)).to(dtype)
        return got


@dataclass
class _Hist2dState:
    prange: tuple[float, float]
    grange: tuple[float, float]
    counts: Tensor
    clamped_grad: Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.int64))
    gmn: Tensor | None = None
    gmx: Tensor | None = None
    #: per window (shared by its micro-steps): parameter name -> :class:`_Theta`
    cache: dict = field(default_factory=dict)
    var: Tensor | None = None  # sampled mode: [P * G] float64 variance of the estimates
    #: sampled mode: parameter name -> Stratum, shared by the window's micro-steps
    strata: dict = field(default_factory=dict)
    #: under ``Lens(groups=...)``: group -> its counters (see :class:`_Hist1dState`)
    parts: dict = field(default_factory=dict)

    def to(self, device) -> None:
        if self.counts.device != device:
            self.counts, self.clamped_grad = self.counts.to(device), self.clamped_grad.to(device)
            if self.var is not None:
                self.var = self.var.to(device)

    def sampled_totals(self) -> tuple[Tensor, Tensor, Tensor]:
        """Sampled mode: (counts, var, clamped_grad) with every parameter's estimate."""
        counts, var, clamped = self.counts.clone(), self.var.clone(), self.clamped_grad.clone()
        if self.strata:
            c, v, lo, hi = estimate(list(self.strata.values()))
            counts, var = counts.to(c.device) + c, var.to(c.device) + v
            clamped = clamped.to(c.device) + lo + hi
        return counts, var, clamped


class GradHist2d(_GroupedHist):
    """``record["grad_hist_2d"]``: :class:`~gradlens.core.records.Hist2d`, the joint histogram of
    (theta_j, g_n,j) over all samples n and tracked entries j, theta being the parameter values
    at which the window's gradients were computed.

    Args:
        bins: ``(param_bins, grad_bins)`` or one int for both (default ``(40, 50)``).
        range: ``((p_lo, p_hi), (g_lo, g_hi))`` (default ``((-1, 1), (-2, 2))``).
        adapt: as in :class:`GradHist1d`, applied to both axes.
        sample, seed: as in :class:`GradHist1d` (estimated counts with ``Hist2d.stderr``; the
            parameter axis stays exact, ``clamped_grad`` is estimated).
    """

    key = "grad_hist_2d"
    needs = frozenset({"per_sample"})
    _counters = ("counts", "clamped_grad", "var")
    max_rows_one_by_one = 0.25  # see update_outer

    def __init__(self, bins=(40, 50), range=((-1.0, 1.0), (-2.0, 2.0)), adapt: str | None = None,
                 sample: float | None = None, seed: int = 0):
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
        self.sample = check_sample(sample)
        _check_size(self.bins[0] * self.bins[1], self.sample is not None, f"GradHist2d(bins={self.bins})")
        self._draws = Draws(seed)

    def __repr__(self) -> str:
        return (
            f"GradHist2d(bins={self.bins}, range=({self.param_range}, {self.grad_range}), "
            f"adapt={self.adapt!r}" + ("" if self.sample is None else f", sample={self.sample}") + ")"
        )

    def start_window(self):
        p, g = self.bins
        if self.sample is not None:
            c = _sampled_counters(p * g)
            return _Hist2dState(self.param_range, self.grad_range, c["counts"], c["low"], var=c["var"])
        return _Hist2dState(self.param_range, self.grad_range, torch.zeros(p * g, dtype=torch.int64))

    def _narrow_window(self, out: _Hist2dState, state: _Hist2dState, keep: set) -> None:
        out.cache = {q: t for q, t in state.cache.items() if q in keep}

    def start_micro(self, window_state: _Hist2dState) -> _Hist2dState:
        state = self.start_window()
        state.cache = window_state.cache  # theta is fixed within a window: bin it once
        state.strata = window_state.strata  # sampled mode: one table per parameter and window
        return state

    #: exact mode bins theta once per window (:meth:`bin_param`)
    bins_param_values = True

    def sharded_refusal(self) -> str | None:
        if self.sample is not None:
            return "in sampled mode it reads sampled entries of the parameter values during backward"
        return None

    def bin_param(self, state: _Hist2dState, name: str, values: Tensor) -> None:
        """Bin parameter ``name``'s values ``[*param]`` for this window now (the window state's
        cache, which its micro-steps share), instead of at its first measurement: under FSDP2
        (gradlens/distributed/fsdp.py) the values are the gathered full parameter, since the
        unsharded one is freed outside its module's backward."""
        self._theta(state, name, values)

    def _theta(self, state: _Hist2dState, name: str, param: Tensor, binned: bool = True) -> _Theta:
        """Theta's window facts; ``binned=False`` (sampled mode) skips the per-entry bins."""
        got = state.cache.get(name)
        if got is None or (binned and got.offsets is None):
            theta = param.detach()
            lo, hi = state.prange
            off = bin_of(theta, lo, hi, self.bins[0], torch.int32).mul_(self.bins[1]) if binned else None
            out = (torch.count_nonzero(theta < lo) + torch.count_nonzero(theta > hi)
                   + torch.count_nonzero(theta.isnan()))
            if self.adapt is not None and theta.numel():
                mn, mx = torch.aminmax(theta.reshape(-1))
            else:
                mn, mx = theta.new_tensor(math.inf), theta.new_tensor(-math.inf)
            got = state.cache[name] = _Theta(off, out, mn, mx)
        return got

    def update(self, state: _Hist2dState, name, param, grad_batch):
        x = grad_batch.detach()
        state.to(x.device)
        dst = self._dst(state, name)
        dst.to(x.device)
        theta = self._theta(state, name, param)
        lo, hi = state.grange
        if device_paths(x):
            tally(dst.counts, bin_of(x, lo, hi, self.bins[1], torch.int32).add_(theta.offsets))
            dst.clamped_grad += (torch.count_nonzero(x < lo) + torch.count_nonzero(x > hi)
                                 + torch.count_nonzero(x.isnan()))
            if self.adapt is not None:
                self._grad_extremes(state, *torch.aminmax(x))
            return
        if not x.numel():
            return
        if native_bins.usable(x):  # one compiled pass: bins, counts, clamped
            dst.clamped_grad += sum(native_bins.count_dense(dst.counts, x, lo, hi, self.bins[1], theta.offsets))
            if self.adapt is not None:
                self._grad_extremes(state, *torch.aminmax(x))
            return
        mn, mx = torch.aminmax(x)
        inside = bool(mn >= lo) and bool(mx <= hi)  # nothing clamped, no NaN: the bins alone
        dst.counts += count_2d(x, theta.dense_offsets(x.dtype, self.bins[1]), lo, hi, self.bins[1], self.bins[0],
                               inside=inside).view(-1)
        if not inside:  # (count_nonzero: faster than a bool sum; only the sides exceeded)
            nan = bool(mn.isnan())
            if nan or not bool(mn >= lo):
                dst.clamped_grad += torch.count_nonzero(x < lo)
            if nan or not bool(mx <= hi):
                dst.clamped_grad += torch.count_nonzero(x > hi) + (torch.count_nonzero(x.isnan()) if nan else 0)
        if self.adapt is not None:
            self._grad_extremes(state, mn, mx)

    def update_sampled(self, state: _Hist2dState, name, param, entries, batch: int) -> None:
        """Sampled mode: as :meth:`GradHist1d.update_sampled`; coordinate j's entries go to
        the row of theta_j's bin."""
        numel = param.numel()
        j = self._draws.coordinates(numel, self.sample, param.device)
        pbins, gbins = self.bins
        self._theta(state, name, param, binned=False)  # clamped theta, extremes
        lo_p, hi_p = state.prange
        rows = bin_of(param.detach().reshape(-1)[j], lo_p, hi_p, pbins)
        st = state.strata.get(name)
        if st is None:
            st = state.strata[name] = Stratum(j.numel(), numel, pbins, gbins, param.device)
        lo, hi = state.grange
        for s, e in st.chunks(batch):
            x = entries(j[s:e]).detach()  # [B, c]
            if self.adapt is not None:
                self._grad_extremes(state, *torch.aminmax(x))
            st.add(x, lo, hi, rows[s:e])

    def update_outer(self, state: _Hist2dState, name, param, delta, a) -> bool:
        """Rank-one layers on the CPU (``delta [B, O]``, ``a [B, I]``, finite): each row (n, o),
        the products ``delta[n, o] * a[n, :]``, is counted by the cheapest exact rule:

        * all its products in one gradient bin g: row o's parameter-bin counts go to column g
          (one small matmul for all such rows);
        * its products on both sides of the zero edge (bins z - 1 and z, nothing else): the sign
          decides, so per parameter entry (o, i) the number of samples with a negative product is
          ``[delta > 0]^T [a < 0] + [delta < 0]^T [a > 0]`` over those rows (two matmuls);
        * any other row: its products binned one by one (in the compiled loop of
          :mod:`gradlens.instruments.native_bins` where it serves: product, bin and count in
          one pass).

        When more than ``max_rows_one_by_one`` (a quarter) of the rows would be binned one by
        one, every product goes through the compiled loop instead (no matmuls, no ``[B, O, I]``
        tensor); without it, returns False (the caller materialises, as for 1D): gathering
        their products costs more than the dense pass.
        """
        if device_paths(delta):
            return False
        pbins, gbins = self.bins
        lo, hi = state.grange
        o, width = delta.shape[1], a.shape[1]  # param's [O, I] (under ZeRO-3 its data may be a [0] partition)
        vmin, vmax = row_extremes(delta, a)
        first, last = bin_of(vmin, lo, hi, gbins), bin_of(vmax, lo, hi, gbins)
        inside = (vmin >= lo) & (vmax <= hi)
        single = (first == last) & inside
        z = _affine(lo, hi, gbins)[1]
        zs = None
        if z is not None and 0 < z < gbins:
            zs = ((first == int(z) - 1) & (last == int(z)) & inside).view_as(delta)
        done = single if zs is None else single | zs.reshape(-1)
        native = native_bins.usable(delta, a)
        many = int(done.numel() - done.sum()) > self.max_rows_one_by_one * done.numel()
        if many and not native:
            return False
        state.to(delta.device)
        dst = self._dst(state, name)
        dst.to(delta.device)
        theta = self._theta(state, name, param)
        if many:  # every product in one compiled pass (no [B, O, I] tensor)
            dst.clamped_grad += sum(native_bins.count_outer(dst.counts, delta, a, lo, hi, gbins, theta.offsets))
            if self.adapt is not None:
                self._grad_extremes(state, vmin.min(), vmax.max())
            return True
        off = theta.offsets  # [O, I] p_bin * G
        row_counts = self._row_counts(theta)  # [O, P]
        rows = torch.arange(delta.numel(), device=delta.device)
        row_i = rows % o
        s_rows = rows[single]
        per_col = torch.bincount(row_i[s_rows] * gbins + first[s_rows], minlength=o * gbins)
        joint = row_counts.t().double() @ per_col.view(o, gbins).double()  # [P, G], exact ints
        dst.counts += joint.round().long().view(-1)
        if zs is not None and bool(zs.any()):
            self._zero_split(dst, zs, delta, a, off, row_counts, int(z))
        multi = rows[~done]
        if native and multi.numel():  # the products of those rows, in one compiled pass
            dst.clamped_grad += sum(native_bins.count_outer(dst.counts, delta, a, lo, hi, gbins, off, multi))
            multi = multi[:0]
        for s, e in sample_chunks(width, multi.numel()):  # [R, I] products per block
            c = multi[s:e]
            x = delta.reshape(-1)[c, None] * a[c // o]  # the same products, [R, I]
            tally(dst.counts, bin_of(x, lo, hi, gbins).add_(off[c % o]))
            dst.clamped_grad += ((x < lo) | (x > hi)).sum()
        if self.adapt is not None:
            self._grad_extremes(state, vmin.min(), vmax.max())
        return True

    def _zero_split(self, state, zs: Tensor, delta: Tensor, a: Tensor, off: Tensor,
                    row_counts: Tensor, z: int) -> None:
        """Rows ``zs [B, O]`` whose products lie in bins z - 1 (negative) and z (zero or
        positive): per parameter bin, how many of their products are negative."""
        f = torch.float64 if delta.shape[0] >= 1 << 24 else torch.float32  # exact counts
        zf = zs.to(f)
        d_pos, d_neg = zf * (delta > 0), zf * (delta < 0)
        neg = d_pos.t() @ (a < 0).to(f) + d_neg.t() @ (a > 0).to(f)  # [O, I] exact counts
        pbins, gbins = self.bins
        neg_p = torch.zeros(pbins, dtype=torch.float64, device=neg.device)
        neg_p.index_add_(0, (off // gbins).reshape(-1), neg.reshape(-1).double())
        all_p = (zs.sum(0).double() @ row_counts.double())  # [P]: products of these rows
        neg_p = neg_p.round().long()
        cells = state.counts.view(pbins, gbins)
        cells[:, z - 1] += neg_p
        cells[:, z] += all_p.round().long() - neg_p

    def update_zeros(self, state: _Hist2dState, name, param, count):
        """``count`` samples whose gradient of ``param`` is exactly zero (a skipped layer):
        each entry j adds ``count`` to the cell (bin of theta_j, bin of 0)."""
        state.to(param.device)
        dst = self._dst(state, name)
        dst.to(param.device)
        off = self._theta(state, name, param).offsets.reshape(-1)
        lo, hi = state.grange
        zero = torch.zeros(1, dtype=torch.float32, device=off.device)
        idx = off + bin_of(zero, lo, hi, self.bins[1])
        dst.counts.index_add_(0, idx, torch.full(idx.shape, count, dtype=dst.counts.dtype,
                                                 device=idx.device))
        if not lo <= 0.0 <= hi:
            dst.clamped_grad += count * full_numel(param)
        if self.adapt is not None:
            z = torch.zeros((), device=off.device)
            self._grad_extremes(state, z, z)

    @staticmethod
    def _grad_extremes(state: _Hist2dState, mn: Tensor, mx: Tensor) -> None:
        state.gmn = mn if state.gmn is None else torch.minimum(state.gmn, mn)
        state.gmx = mx if state.gmx is None else torch.maximum(state.gmx, mx)

    def _row_counts(self, theta: _Theta) -> Tensor:
        """``[O, P]`` parameter-bin counts of each row of a 2-D parameter (once per window)."""
        if theta.rows is None:
            off = theta.offsets
            o = off.shape[0]
            pbins, gbins = self.bins
            ids = torch.arange(o, device=off.device)[:, None] * pbins + off // gbins
            theta.rows = torch.bincount(ids.view(-1), minlength=o * pbins).view(o, pbins)
        return theta.rows

    def merge(self, a: _Hist2dState, b: _Hist2dState) -> _Hist2dState:
        return _Hist2dState(
            a.prange, a.grange, a.counts + b.counts.to(a.counts.device),
            a.clamped_grad + b.clamped_grad.to(a.clamped_grad.device),
            _pick(torch.minimum, a.gmn, b.gmn), _pick(torch.maximum, a.gmx, b.gmx),
            cache=a.cache, var=_pick(torch.add, a.var, b.var), strata=merge_strata(a.strata, b.strata),
            parts=self._merge_parts(a, b),
        )

    def finalize(self, stats: WindowStats, state: _Hist2dState) -> Hist2d:
        if state.parts:
            state = self._whole(state)
        pb, gb = self.bins
        sampled = state.var is not None
        if sampled:
            counts, var, clamped = state.sampled_totals()
        else:
            counts, var, clamped = state.counts, None, state.clamped_grad
        return Hist2d(
            counts=counts.view(pb, gb).cpu().clone(),
            param_edges=_edges(*state.prange, pb),
            grad_edges=_edges(*state.grange, gb),
            clamped_param=sum(int(t.clamped) for t in state.cache.values()) * stats.num_samples,
            clamped_grad=float(clamped) if sampled else int(clamped),
            stderr=var.sqrt().view(pb, gb).cpu() if sampled else None,
            sample=self.sample,
        )

    def end_window(self, state: _Hist2dState) -> None:
        thetas = list(state.cache.values())
        pmn = min((float(t.mn) for t in thetas), default=math.inf)
        pmx = max((float(t.mx) for t in thetas), default=-math.inf)
        self.param_range = _adapted(self.param_range, pmn, pmx, self.adapt)
        self.grad_range = _adapted(
            self.grad_range, _num(state.gmn, math.inf), _num(state.gmx, -math.inf), self.adapt
        )

    # ---- across ranks (gradlens.distributed.merge): counts add, extremes are shared per rank ----
    # (theta is the same on every rank under data parallelism: the parameter side needs nothing)
    @staticmethod
    def _sums(state: _Hist2dState) -> list:
        if state.var is not None:  # independent ranks: estimates and variances add
            counts, var, clamped = state.sampled_totals()
            return [counts, clamped, var]
        return [state.counts, state.clamped_grad]

    def to_buffers(self, state: _Hist2dState, ctx):
        """As :meth:`GradHist1d.to_buffers`."""
        per_rank = [_extremes_row(state.gmn, state.gmx)] if self.adapt is not None else []
        groups = getattr(ctx, "groups", ())
        if groups:  # the strata belong to the groups: only the exactly known counters here
            own = [state.counts, state.clamped_grad] + ([state.var] if state.var is not None else [])
            sums = own + self._group_sums(state, ctx, self._sums)
        else:
            sums = self._sums(self._whole(state) if state.parts else state)
        return DistParts(sums=sums, per_rank=per_rank)

    def from_buffers(self, state: _Hist2dState, ctx, sums, per_rank, pieces) -> _Hist2dState:
        mn, mx = _merged_extremes(per_rank)
        k = 3 if state.var is not None else 2
        var = sums[2] if k == 3 else None
        out = _Hist2dState(state.prange, state.grange, sums[0], sums[1], mn, mx, cache=state.cache, var=var)
        for i, g in enumerate(getattr(ctx, "groups", ())):
            c = sums[k * (i + 1): k * (i + 2)]
            out.parts[g] = _Hist2dState(state.prange, state.grange, c[0], c[1], var=c[2] if k == 3 else None)
        return out

    # ---- checkpoints (gradlens.lens.state) ----------------------------------------------------
    def state_dict(self) -> dict:
        """As :meth:`GradHist1d.state_dict`, with ``param_range`` and ``grad_range``."""
        return {
            **self._settings(), "param_range": list(self.param_range),
            "grad_range": list(self.grad_range), "draws": self._draws.count,
        }

    def load_state_dict(self, state: dict) -> None:
        checks = {"param_range": RANGE, "grad_range": RANGE, "draws": COUNT}
        check_state(self, state, checks, same=self._settings())
        self.param_range = (float(state["param_range"][0]), float(state["param_range"][1]))
        self.grad_range = (float(state["grad_range"][0]), float(state["grad_range"][1]))
        self._draws.count = state["draws"]

    def _settings(self) -> dict:
        return {"bins": list(self.bins), "adapt": self.adapt, "sample": self.sample, "seed": self._draws.seed}
