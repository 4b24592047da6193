"""Histograms of per-sample gradient elements: 1D (g_n,j) and 2D (theta_j, g_n,j).

Binning (both axes): element x falls in bin ``floor((x - lo) * bins / (hi - lo))`` clamped to
``[0, bins - 1]``; values below ``lo`` count in the first bin, values at or above ``hi`` in the
last, and the number clamped is recorded. When 0 is an edge (a symmetric range with an even
number of bins) the sign decides exactly: ``0`` and positive values fall in the bin right of
zero, ``[0, w)``, negative ones left of it, however small (see
:func:`~gradlens.instruments.binning.bin_of`). Non-finite values count as out of range (-inf
low; +inf and NaN high).

Cost: one pass per layer over its per-sample elements, no Python loop over samples or bins: on
the CPU a compiled loop (:mod:`gradlens.instruments.native_bins`) forms, bins and counts each
element (2D: at its combined index ``param_bin * grad_bins + grad_bin``); elsewhere, or without
a C compiler, vectorised torch passes over slices of samples (bin index, then one ``bincount``). The parameter values, and so their bins, are fixed within a window: they are
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
from gradlens.instruments import native_bins
from gradlens.instruments.binning import _affine, bin_of, count_1d
from gradlens.instruments.outer_hist import outer_hist1d
from gradlens.instruments.sampling import Draws, Stratum, check_sample, estimate, merge_strata
from gradlens.core.records import Hist1d
from gradlens.core.state_checks import COUNT, RANGE, check_state
from gradlens.core.sync import device_paths
from gradlens.core.param_shapes import local_numel
from gradlens.core.limits import MAX_BINS  # read here: raise it with gradlens.instruments.hist.MAX_BINS = ...


__all__ = ["GradHist1d"]


_ADAPT = (None, "abs_max", "min_max")


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
        self._narrow_window(out, state, keep)
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

    def _narrow_window(self, out, state, keep: set) -> None:
        """``group_state``'s view ``out`` of ``state`` keeps only the parameters ``keep`` of what
        the window shares beyond the counts (none here; GradHist2d: its binned theta)."""


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
    #: under tensor parallelism (gradlens/distributed/tensor_parallel.py) each rank bins the
    #: entries of its own parameter blocks, so the exact counts add over the TP group like over
    #: data ranks, and the extremes are shared the same way: its rank merge serves as is
    tp_merges_by_sums = True
    _counters = ("counts", "low", "high", "var")
    #: where the compiled loop (:mod:`gradlens.instruments.native_bins`) serves, rank-one layers
    #: take the sorted-row search only when it has fewer positions to find than this fraction of
    #: their ``B * O * I`` products, else the loop counts them all (measured on the CPU: a
    #: position about 200 ns, the loop 1-1.5 ns a product)
    max_search_native = 1 / 128

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
        if x.numel() and native_bins.usable(x):  # one compiled pass: bins, counts, clamped
            low, high = native_bins.count_dense(dst.counts, x, lo, hi, self.bins)
            dst.low += low
            dst.high += high
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
        from sorted factors (:mod:`gradlens.instruments.outer_hist`) where the rows span few
        bins, else every product in the compiled loop (:mod:`gradlens.instruments.native_bins`,
        no ``[B, O, I]`` tensor); False where neither serves (the caller materialises), and on
        the device paths (the searches have data-dependent sizes)."""
        if device_paths(delta):
            return False
        native = native_bins.usable(delta, a)
        out = outer_hist1d(delta, a, state.lo, state.hi, self.bins,
                           **({"max_cost": self.max_search_native} if native else {}))
        if out is None and not native:
            return False
        dst = self._dst(state, name)
        dst.to(delta.device)
        if out is None:  # every product in one compiled pass (no [B, O, I] tensor)
            low, high = native_bins.count_outer(dst.counts, delta, a, state.lo, state.hi, self.bins)
        else:
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
        n = count * local_numel(param)  # (tensor parallelism: this rank's block)
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
