"""Histograms of per-sample gradient elements: 1D (g_n,j) and 2D (theta_j, g_n,j).

Binning (both axes): element x falls in bin ``floor((x - lo) * bins / (hi - lo))`` clamped to
``[0, bins - 1]``; values below ``lo`` count in the first bin, values at or above ``hi`` in the
last, and the number clamped is recorded. When 0 is an edge (a symmetric range with an even
number of bins) the sign decides exactly: ``0`` and positive values fall in the bin right of
zero, ``[0, w)``, negative ones left of it, however small (see
:func:`~gradlens.instruments.binning.bin_of`). Non-finite values count as out of range (-inf
low; +inf and NaN high).

Cost: one vectorised pass per layer over slices of samples (bin index, then one ``bincount``;
for 2D over the combined index ``param_bin * grad_bins + grad_bin``); no Python loop over
samples or bins. The parameter values, and so their bins, are fixed within a window: they are
binned once per window. On the CPU, rank-one layers (Linear without a sequence axis) take exact
shortcuts that touch far fewer than B x D elements (:mod:`gradlens.instruments.outer_hist` for
1D; for 2D the rows of a sample whose products lie in one bin, or on both sides of the zero edge,
are counted with small matmuls). On an accelerator the per-micro-step work makes no host read
(:mod:`gradlens.core.sync`). The range is fixed within a window, so micro-step counts add; ``adapt``
sets the next window's range from this window's extremes.

Size: a histogram has at most :data:`MAX_BINS` bins (2D: ``param_bins * grad_bins``), checked
at construction with the memory and log size in the message: its counts live in every window
and micro-step state and every record, and a log line (:class:`gradlens.output.sinks.JsonlSink`)
writes them in full, so ``bins=10**7`` would be a 174 MB line per window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from gradlens.instruments.base import Instrument

from gradlens.core.stats import DistParts, WindowStats
from gradlens.instruments.crosssample import _human
from gradlens.instruments.binning import _affine, bin_of, count_1d, count_2d, tally
from gradlens.instruments.outer_hist import outer_hist1d, row_extremes
from gradlens.instruments.sampling import Draws, Stratum, check_sample, estimate, merge_strata
from gradlens.kernels.base import sample_chunks
from gradlens.core.records import Hist1d, Hist2d
from gradlens.core.state_checks import COUNT, RANGE, check_state
from gradlens.core.sync import device_paths


__all__ = ["GradHist1d", "GradHist2d"]


_ADAPT = (None, "abs_max", "min_max")

#: most bins of one histogram (2D: param_bins * grad_bins): 128 KB of int64 counts per state and
#: a log line of about 0.3 MB (counts and edges, ~20 bytes a bin); raise it here
#: (gradlens.instruments.hist.MAX_BINS = ...) only where that memory and log size are intended
MAX_BINS = 1 << 14

#: bytes of a log line per bin (a count and an edge as JSON), for the estimate in the message
_LOG_BYTES_PER_BIN = 20


def _check_bins(bins, what: str) -> int:
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise ValueError(f"{what} must be a positive int, got {bins!r}")
    return bins


def _check_size(total: int, sampled: bool, call: str) -> None:
    """Refuse a histogram of more than :data:`MAX_BINS` bins, with what it would cost."""
    if total > MAX_BINS:
        per_bin = 16 if sampled else 8  # sampled: float64 estimates and their variances
        raise ValueError(
            f"{call} has {total} bins: {_human(per_bin * total)} of counts in every window and "
            f"micro-step state and every record, and about {_human(_LOG_BYTES_PER_BIN * total)} "
            f"in every log line, over "
            f"gradlens.instruments.hist.MAX_BINS = {MAX_BINS}; use fewer bins (e.g. 100 to "
            f"1000 per axis), or raise gradlens.instruments.hist.MAX_BINS where that is intended"
        )


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
    z = _affine(lo, hi, bins)[1]
    if z is not None:
        edges[int(z)] = 0.0
    return edges


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
    counts: Tensor  # [bins] int64, clamped values included
    low: Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.int64))
    high: Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.int64))
    mn: Tensor | None = None  # extremes seen (only with adapt), on the gradients' device
    mx: Tensor | None = None
    var: Tensor | None = None  # sampled mode: [bins] float64 variance of the estimated counts
    #: sampled mode: parameter name -> Stratum, shared by the window's micro-steps
    strata: dict = field(default_factory=dict)
    #: under ``Lens(groups=...)``: group -> its counters (a state without extremes or strata);
    #: the counters above then hold nothing and the histogram is the sum of the parts
    parts: dict = field(default_factory=dict)

    def to(self, device) -> None:
        """Keep the counters on the gradients' device (no host sync per slice)."""
        if self.counts.device != device:
            self.counts, self.low, self.high = (t.to(device) for t in (self.counts, self.low, self.high))
            if self.var is not None:
                self.var = self.var.to(device)

    def sampled_totals(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Sampled mode: (counts, var, low, high), the exactly known part plus every
        parameter's estimate."""
        counts, var, low, high = self.counts.clone(), self.var.clone(), self.low.clone(), self.high.clone()
        if self.strata:
            c, v, lo, hi = estimate(list(self.strata.values()))
            counts, var = counts.to(c.device) + c, var.to(c.device) + v
            low, high = low.to(c.device) + lo, high.to(c.device) + hi
        return counts, var, low, high


def _sampled_counters(bins: int) -> dict:
    """Float64 counters of the sampled mode (estimates, their variance, clamped estimates)."""
    z = lambda *shape: torch.zeros(shape, dtype=torch.float64)  # noqa: E731
    return {"counts": z(bins), "var": z(bins), "low": z(), "high": z()}


class _GroupedHist(Instrument):
    """Histograms per parameter group: the counters of each group's parameters go to its own
    part of the state (no extra pass: each element is binned once, into its group's counts);
    the record's histogram is the sum of the parts, a group's is its part."""

    per_group = True
    _group_of: dict = {}
    #: the state fields that are counters (the rest is shared: range, extremes, caches)
    _counters: tuple = ()

    def bind_groups(self, group_of: dict[str, str]) -> None:
        self._group_of = dict(group_of)

    def _dst(self, state, name: str):
        """The state whose counters take parameter ``name``'s elements: its group's part."""
        group = self._group_of.get(name) if self._group_of else None
        if group is None:
            return state
        part = state.parts.get(group)
        if part is None:
            part = state.parts[group] = self._empty_like(state)
        return part

    def _empty_like(self, state):
        """Zero counters like ``state``'s, on its device."""
        fresh = self.start_window()
        for f in self._counters:
            t = getattr(fresh, f)
            if t is not None:
                setattr(fresh, f, t.to(state.counts.device))
        return fresh

    def _merge_parts(self, a, b) -> dict:
        if not a.parts and not b.parts:
            return {}
        out = dict(a.parts)
        for g, p in b.parts.items():
            out[g] = self._add_counters(out[g], p) if g in out else p
        return out

    def _add_counters(self, a, b):
        kw = {f: _pick(torch.add, getattr(a, f), getattr(b, f)) for f in self._counters}
        return type(a)(**{**{k: getattr(a, k) for k in a.__dataclass_fields__}, **kw, "parts": {}})

    def _whole(self, state):
        """The state with every group's counters added into its own (a new state)."""
        out = type(state)(**{k: getattr(state, k) for k in state.__dataclass_fields__})
        out.parts = {}
        for p in state.parts.values():
            out = self._add_counters(out, p)
            out.parts = {}
        return out

    def group_state(self, state, names):
        """The group's counters, with its parameters' strata (sampled) and theta bins (2D)."""
        group = self._group_of.get(names[0]) if self._group_of else None
        part = state.parts.get(group) if group is not None else None
        if part is None:
            part = self._empty_like(state)
        out = type(state)(**{k: getattr(state, k) for k in state.__dataclass_fields__})
        for f in self._counters:
            setattr(out, f, getattr(part, f))
        keep = set(names)
        out.strata = {q: st for q, st in state.strata.items() if q in keep}
        if hasattr(out, "cache"):
            out.cache = {q: t for q, t in state.cache.items() if q in keep}
        out.parts = {}
        return out

    def _group_sums(self, state, ctx, totals) -> list:
        """Under groups: per group of ``ctx.groups`` its counters (``totals`` of its state)."""
        sums = []
        if not ctx.groups:
            return sums
        members: dict[str, list[str]] = {}
        for q, g in self._group_of.items():
            members.setdefault(g, []).append(q)
        for g in ctx.groups:
            sums += totals(self.group_state(state, members.get(g, [""])))
        return sums


class GradHist1d(_GroupedHist):
    """``record["grad_hist_1d"]``: :class:`~gradlens.core.records.Hist1d` of every element of every
    per-sample gradient g_n over the tracked parameters (N * D elements per window).

    Args:
        bins: number of bins (default 100, as cockpit-for-pytorch).
        range: ``(lo, hi)`` of the first window (default ``(-2, 2)``).
        adapt: ``None`` (fixed range), ``"abs_max"`` (next range ``(-m, m)``, m the largest
            |g_n,j| of this window) or ``"min_max"`` (next range = this window's extremes).
        sample: ``None`` (exact counts) or a fraction in (0, 1): per layer and micro-step that
            fraction of its ``B * D`` elements is drawn at random and the counts are unbiased
            estimates (float64) with their standard error in ``Hist1d.stderr``; cost falls with
            the fraction (:mod:`gradlens.instruments.sampling`). With ``adapt`` the next range
            comes from the sampled extremes.
        seed: seed of the sampling stream (the global torch random state is not used).
    """

    key = "grad_hist_1d"
    needs = frozenset({"per_sample"})
    _counters = ("counts", "low", "high", "var")

    def __init__(self, bins: int = 100, range=(-2.0, 2.0), adapt: str | None = None,
                 sample: float | None = None, seed: int = 0):
        self.bins = _check_bins(bins, "bins")
        self.range = _check_range(range, "range")
        self.adapt = _check_adapt(adapt)
        self.sample = check_sample(sample)
        _check_size(self.bins, self.sample is not None, f"GradHist1d(bins={self.bins})")
        self._draws = Draws(seed)

    def __repr__(self) -> str:
        extra = "" if self.sample is None else f", sample={self.sample}"
        return f"GradHist1d(bins={self.bins}, range={self.range}, adapt={self.adapt!r}{extra})"

    def start_window(self):
        if self.sample is not None:
            return _Hist1dState(*self.range, **_sampled_counters(self.bins))
        return _Hist1dState(*self.range, torch.zeros(self.bins, dtype=torch.int64))

    def start_micro(self, window_state: _Hist1dState) -> _Hist1dState:
        state = self.start_window()
        state.strata = window_state.strata  # sampled mode: one table per parameter and window
        return state

    def update_sampled(self, state: _Hist1dState, name, param, entries, batch: int) -> None:
        """Sampled mode: draw coordinates of ``param``, bin the entries of every sample there
        (``entries(j) -> [B, m]``) into its window table (:mod:`gradlens.instruments.sampling`)."""
        numel = param.numel()
        j = self._draws.coordinates(numel, self.sample, param.device)
        st = state.strata.get(name)
        if st is None:
            st = state.strata[name] = Stratum(j.numel(), numel, 1, self.bins, param.device)
        for s, e in st.chunks(batch):
            x = entries(j[s:e]).detach()  # [B, c]
            if self.adapt is not None:
                self._extremes(state, x)
            st.add(x, state.lo, state.hi)

    def update(self, state: _Hist1dState, name, param, grad_batch):
        x = grad_batch.detach()
        dst = self._dst(state, name)
        dst.to(x.device)
        lo, hi = state.lo, state.hi
        if device_paths(x):
            dst.counts += count_1d(x, lo, hi, self.bins)
            dst.low += torch.count_nonzero(x < lo)
            dst.high += torch.count_nonzero(x > hi) + torch.count_nonzero(x.isnan())
            if self.adapt is not None:
                self._extremes(state, x)
            return
        mn, mx = torch.aminmax(x) if x.numel() else (None, None)
        if mn is None or (bool(mn >= lo) and bool(mx <= hi)):  # nothing clamped, no NaN: the bins alone
            dst.counts += count_1d(x, lo, hi, self.bins, inside=True)
        else:  # (count_nonzero: faster than a bool sum; only the sides exceeded)
            dst.counts += count_1d(x, lo, hi, self.bins)
            nan = bool(mn.isnan())
            if nan or not bool(mn >= lo):
                dst.low += torch.count_nonzero(x < lo)
            if nan or not bool(mx <= hi):
                dst.high += torch.count_nonzero(x > hi) + (torch.count_nonzero(x.isnan()) if nan else 0)
        if self.adapt is not None and mn is not None:
            self._extremes(state, torch.stack([mn, mx]))  # (NaN if x has one, as aminmax(x))

    def update_outer(self, state: _Hist1dState, name, param, delta, a) -> bool:
        """Rank-one layers (g_n = delta_n a_n^T, ``delta [B, O]``, ``a [B, I]``): exact counts
        from sorted factors (:mod:`gradlens.instruments.outer_hist`); False if too costly, and
        on the device paths (its searches have data-dependent sizes)."""
        if device_paths(delta):
            return False
        out = outer_hist1d(delta, a, state.lo, state.hi, self.bins)
        if out is None:
            return False
        dst = self._dst(state, name)
        dst.to(delta.device)
        counts, low, high = out
        dst.counts += counts
        dst.low += low
        dst.high += high
        if self.adapt is not None:
            ext = torch.stack([delta.amin(1) * a.amin(1), delta.amin(1) * a.amax(1),
                               delta.amax(1) * a.amin(1), delta.amax(1) * a.amax(1)])
            self._extremes(state, ext)
        return True

    def update_zeros(self, state: _Hist1dState, name, param, count):
        """``count`` samples whose gradient of ``param`` is exactly zero (a skipped layer)."""
        n = count * param.numel()
        dst = self._dst(state, name)
        dst.to(param.device)
        zero = torch.zeros(1, dtype=torch.float32, device=dst.counts.device)
        dst.counts.index_add_(0, bin_of(zero, state.lo, state.hi, self.bins),
                              torch.full((1,), n, dtype=dst.counts.dtype, device=zero.device))
        if 0.0 < state.lo:
            dst.low += n
        elif 0.0 > state.hi:
            dst.high += n
        if self.adapt is not None:
            self._extremes(state, zero)

    @staticmethod
    def _extremes(state: _Hist1dState, x: Tensor) -> None:
        mn, mx = torch.aminmax(x)  # kept as tensors: no device sync per slice
        state.mn = mn if state.mn is None else torch.minimum(state.mn, mn)
        state.mx = mx if state.mx is None else torch.maximum(state.mx, mx)

    def merge(self, a: _Hist1dState, b: _Hist1dState) -> _Hist1dState:
        dev = a.counts.device
        return _Hist1dState(
            a.lo, a.hi, a.counts + b.counts.to(dev), a.low + b.low.to(dev), a.high + b.high.to(dev),
            _pick(torch.minimum, a.mn, b.mn), _pick(torch.maximum, a.mx, b.mx),
            _pick(torch.add, a.var, b.var), merge_strata(a.strata, b.strata), self._merge_parts(a, b),
        )

    def finalize(self, stats: WindowStats, state: _Hist1dState) -> Hist1d:
        if state.parts:
            state = self._whole(state)
        edges = _edges(state.lo, state.hi, self.bins)
        if state.var is not None:
            counts, var, low, high = state.sampled_totals()
            return Hist1d(counts.cpu(), edges, float(low), float(high), stderr=var.sqrt().cpu(),
                          sample=self.sample)
        return Hist1d(state.counts.cpu().clone(), edges, int(state.low), int(state.high))

    def end_window(self, state: _Hist1dState) -> None:
        self.range = _adapted(self.range, _num(state.mn, math.inf), _num(state.mx, -math.inf), self.adapt)

    # ---- across ranks (gradlens.distributed.merge): counts add, extremes are shared per rank ----
    @staticmethod
    def _sums(state: _Hist1dState) -> list:
        if state.var is not None:  # independent ranks: estimates and variances add
            counts, var, low, high = state.sampled_totals()
            return [counts, low, high, var]
        return [state.counts, state.low, state.high]

    def to_buffers(self, state: _Hist1dState, ctx):
        """Counts add across ranks (groups: each group's counters, in ``ctx.groups``' order)."""
        groups = getattr(ctx, "groups", ())
        if groups:  # the strata belong to the groups: only the exactly known counters here
            own = [state.counts, state.low, state.high] + ([state.var] if state.var is not None else [])
            sums = own + self._group_sums(state, ctx, self._sums)
        else:
            sums = self._sums(self._whole(state) if state.parts else state)
        per_rank = [_extremes_row(state.mn, state.mx)] if self.adapt is not None else []
        return DistParts(sums=sums, per_rank=per_rank)

    def from_buffers(self, state: _Hist1dState, ctx, sums, per_rank, pieces) -> _Hist1dState:
        mn, mx = _merged_extremes(per_rank)
        k = 4 if state.var is not None else 3
        var = sums[3] if k == 4 else None
        out = _Hist1dState(state.lo, state.hi, sums[0], sums[1], sums[2], mn, mx, var)
        for i, g in enumerate(getattr(ctx, "groups", ())):
            c = sums[k * (i + 1): k * (i + 2)]
            out.parts[g] = _Hist1dState(state.lo, state.hi, c[0], c[1], c[2], var=c[3] if k == 4 else None)
        return out

    # ---- checkpoints (gradlens.lens.state) ----------------------------------------------------
    def state_dict(self) -> dict:
        """Settings that give the kept state its meaning (``bins``, ``adapt``, ``sample``,
        ``seed``: checked on load) and what changes between windows: ``range`` (the next
        window's ``[lo, hi]``, adapted) and ``draws`` (the sampling stream's counter)."""
        return {**self._settings(), "range": list(self.range), "draws": self._draws.count}

    def load_state_dict(self, state: dict) -> None:
        check_state(self, state, {"range": RANGE, "draws": COUNT}, same=self._settings())
        self.range = (float(state["range"][0]), float(state["range"][1]))
        self._draws.count = state["draws"]

    def _settings(self) -> dict:
        return {"bins": self.bins, "adapt": self.adapt, "sample": self.sample, "seed": self._draws.seed}


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

    def start_micro(self, window_state: _Hist2dState) -> _Hist2dState:
        state = self.start_window()
        state.cache = window_state.cache  # theta is fixed within a window: bin it once
        state.strata = window_state.strata  # sampled mode: one table per parameter and window
        return state

    def bin_param(self, state: _Hist2dState, name: str, values: Tensor) -> None:
        """Bin parameter ``name``'s values ``[*param]`` for this window now (the window state's
        cache, which its micro-steps share), instead of at its first measurement: under FSDP2
        (gradlens/fsdp.py) the values are the gathered full parameter, since the unsharded one
        is freed outside its module's backward."""
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
        * any other row: its products binned one by one.

        Returns False (the caller materialises, as for 1D) when more than
        ``max_rows_one_by_one`` (a quarter) of the rows would be binned one by one: gathering
        their products costs more than the dense pass.
        """
        if device_paths(delta):
            return False
        pbins, gbins = self.bins
        lo, hi = state.grange
        o, width = param.shape
        vmin, vmax = row_extremes(delta, a)
        first, last = bin_of(vmin, lo, hi, gbins), bin_of(vmax, lo, hi, gbins)
        inside = (vmin >= lo) & (vmax <= hi)
        single = (first == last) & inside
        z = _affine(lo, hi, gbins)[1]
        zs = None
        if z is not None and 0 < z < gbins:
            zs = ((first == int(z) - 1) & (last == int(z)) & inside).view_as(delta)
        done = single if zs is None else single | zs.reshape(-1)
        if int(done.numel() - done.sum()) > self.max_rows_one_by_one * done.numel():
            return False
        state.to(delta.device)
        dst = self._dst(state, name)
        dst.to(delta.device)
        theta = self._theta(state, name, param)
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
            dst.clamped_grad += count * param.numel()
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
