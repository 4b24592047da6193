"""Exact 1D histograms of rank-one per-sample gradients without materialising them.

For a Linear layer without a sequence axis, g_n = delta_n a_n^T: row i of sample n holds the
values delta_ni * a_nj over j. Rounding is monotone, so with a_n sorted, the products of one row
are sorted too (reversed when delta_ni < 0), and so is their bin
``floor((x - lo) * bins / (hi - lo))``. A row that spans the bins f..l therefore needs only the
l - f positions where its bin changes, instead of touching all d_in elements. Each position is
found from the edge: ``torch.searchsorted`` of edge / delta_ni in the sorted a_n gives it up to
the rounding of that quotient, and a check of the very same float products the materialised
path would bin moves it to the exact one (over runs of equal values; a binary search over the
products settles the rare position the check does not). Most rows span a few bins, so the cost
drops from O(B d_out d_in) to about O(B d_out (span + log d_in)); rows that span many bins make
the caller fall back to the materialised path (see :func:`outer_hist1d`).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from gradlens.instruments.binning import _affine, bin_of

__all__ = ["bin_thresholds", "outer_hist1d", "row_extremes"]


def row_extremes(delta: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
    """``[B * O]`` min and max over j of delta[n, i] * a[n, j] (the same float products)."""
    amin, amax = a.amin(1, keepdim=True), a.amax(1, keepdim=True)
    pos = delta >= 0
    vmin = torch.where(pos, delta * amin, delta * amax).reshape(-1)
    vmax = torch.where(pos, delta * amax, delta * amin).reshape(-1)
    return vmin, vmax


def _first_false(pred, rows: Tensor, width: int, steps: int, start: Tensor | None = None) -> Tensor:
    """For each row, the first rank j in [0, width] where the monotone ``pred(rows, j)`` is False
    (a binary search: ``steps`` rounds over every row)."""
    lo_j = torch.zeros_like(rows) if start is None else start
    hi_j = torch.full_like(rows, width)
    for _ in range(steps):
        mid = (lo_j + hi_j) // 2
        true = pred(rows, mid.clamp(max=width - 1)) & (mid < width)
        lo_j = torch.where(true, mid + 1, lo_j)
        hi_j = torch.where(true, hi_j, mid)
    return lo_j


def _runs(asc: Tensor) -> tuple[Tensor, Tensor]:
    """``(start, end)`` ``[B, I]``: the run of values equal to ``asc[n, j]`` in the ascending rows
    of ``asc`` is ``[start[n, j], end[n, j])``."""
    b, w = asc.shape
    j = torch.arange(w, device=asc.device).expand(b, w)
    step = asc[:, 1:] != asc[:, :-1]
    first = torch.cat([torch.ones_like(asc[:, :1], dtype=torch.bool), step], 1)
    last = torch.cat([step, torch.ones_like(asc[:, :1], dtype=torch.bool)], 1)
    start = torch.where(first, j, 0).cummax(1).values
    end = torch.where(last, j + 1, w).flip(1).cummin(1).values.flip(1)
    return start, end


def _below(asc: Tensor, sample: Tensor, t: Tensor) -> Tensor:
    """``#{j: asc[sample[q], j] < t[q]}`` for each query q (``sample`` ascending): one batched
    ``searchsorted`` over the rows of ``asc``, the queries of each row padded to the longest."""
    b, w = asc.shape
    counts = torch.bincount(sample, minlength=b)
    widest = int(counts.max())
    slot = torch.arange(sample.numel(), device=sample.device) - (torch.cumsum(counts, 0) - counts)[sample]
    at = sample * widest + slot
    padded = asc.new_full((b * widest,), math.inf)
    padded[at] = t
    return torch.searchsorted(asc, padded.view(b, widest)).view(-1)[at]

class _Rows:
    """The rows ``r = n * O + i`` of the products ``delta[n, i] * a[n, j]``, each ascending:
    row r reads table row ``t_r`` of ``tab [2B, I]`` (``n``: a_n ascending, for ``delta >= 0``;
    ``B + n``: -a_n reversed, ascending, for ``delta < 0``) with multiplier ``m_r = |delta|``,
    so that its rank-j product ``m_r * tab[t_r, j]`` is the very float ``delta * a`` (negation is
    exact) and rises with j."""

    def __init__(self, delta: Tensor, a: Tensor):
        b, o = delta.shape
        self.width = a.shape[1]
        self.steps = max(1, math.ceil(math.log2(self.width + 1)))
        asc = a.sort(dim=1).values
        self.tab = torch.cat([asc, asc.flip(1).neg()])  # [2B, I], every row ascending
        self.flat = self.tab.reshape(-1)
        d = delta.reshape(-1)
        self.m = d.abs()
        self.t = torch.arange(b, device=d.device).repeat_interleave(o) + b * (d < 0)
        #: the rows in ascending order of their table row (queries made in this order are)
        self.order = torch.argsort(self.t, stable=True)
        self._runs = None

    def first_below(self, t: Tensor, m: Tensor, limit: Tensor) -> Tensor:
        """For each query q (table rows ``t`` ascending, multipliers ``m``, ``limit`` of the
        products' dtype), how many products ``m[q] * tab[t[q], j]`` are ``< limit[q]``: the first
        rank j in [0, I] whose product is not below it.

        The rank is first read from the table (limit / m by ``searchsorted``: exact up to the
        rounding of that quotient and of the products), then the queries it does not settle are
        moved over runs of equal entries until the product of rank j - 1 is below the limit and
        that of rank j is not (the very float products the materialised path forms); the few
        that do not settle within 4 moves get a binary search over the products."""
        w, top = self.width, self.width - 1
        base = t * w
        flat = self.flat

        def below(j: Tensor, q: Tensor | None = None) -> Tensor:  # is the product of rank j < limit?
            if q is None:
                return m * flat[base + j] < limit
            return m[q] * flat[base[q] + j] < limit[q]

        j = _below(self.tab, t, (limit.double() / m.double()).to(self.tab.dtype))
        zero = m == 0  # every product is +-0: all ranks or none lie below the limit
        if bool(zero.any()):
            j = torch.where(zero, torch.where(below(torch.zeros_like(j)), w, 0), j)
        if self._runs is None:
            self._runs = tuple(r.reshape(-1) for r in _runs(self.tab))
        start, end = self._runs

        def wrong(j, q=None):  # rank j - 1 is not below (too far), or rank j is (not far enough)
            left = (j > 0) & ~below((j - 1).clamp(min=0), q)
            right = (j < w) & below(j.clamp(max=top), q)
            return left, right

        left, right = wrong(j)
        bad = (left | right).nonzero().squeeze(1)
        left, right = left[bad], right[bad]
        for _ in range(4):  # only the queries not settled yet
            if not bad.numel():
                return j
            # jump over the run of equal entries at the rank in question
            jb = j[bad]
            col = base[bad] + torch.where(left, jb - 1, jb).clamp(0, top)
            jb = torch.where(left, start[col], torch.where(right, end[col], jb))
            j[bad] = jb
            left, right = wrong(jb, bad)
            still = left | right
            bad, left, right = bad[still], left[still], right[still]
        if bad.numel():
            j[bad] = _first_false(lambda r, jj: below(jj, bad[r]), torch.arange(bad.numel(), device=j.device),
                                  w, self.steps)
        return j


def outer_hist1d(
    delta: Tensor, a: Tensor, lo: float, hi: float, bins: int, max_cost: float = 0.0625
) -> tuple[Tensor, Tensor, Tensor] | None:
    """Histogram of every product ``delta[n, i] * a[n, j]``.

    Args:
        delta: ``[B, O]`` per-sample output gradients (finite).
        a: ``[B, I]`` layer inputs (finite).
        lo, hi, bins: the histogram (clamping rule of :class:`~gradlens.core.records.Hist1d`).
        max_cost: give up (return None) when the positions to find (one per bin edge inside a
            row's span, one per row reaching past ``lo`` or ``hi``) exceed this fraction of the
            ``B * O * I`` elements (a position costs about what binning a dozen materialised
            elements does), or when a sample has fewer than 2 log2(I) rows (the sort would not
            pay off); the caller then materialises.

    Returns:
        ``(counts [bins] int64 with the clamped values included, low, high)`` (0-d int64), or None.
    """
    b, o = delta.shape
    width = a.shape[1]
    if delta.dtype not in (torch.float32, torch.float64) or a.dtype != delta.dtype:
        return None
    if o < 2 * max(1, math.ceil(math.log2(width + 1))):  # too few rows per sample to pay for sorting a_n
        return None
    vmin, vmax = row_extremes(delta, a)  # the products of ranks 0 and I - 1 of each row
    f, l = bin_of(vmin, lo, hi, bins), bin_of(vmax, lo, hi, bins)
    span = l - f
    pairs = int(span.sum())
    low_mask, high_mask = vmin < lo, vmax > hi
    if pairs + int(low_mask.sum()) + int(high_mask.sum()) > max_cost * delta.numel() * width:
        return None
    dtype, dev = a.dtype, delta.device
    thresholds = bin_thresholds(lo, hi, bins, dtype, dev) if pairs else None
    if pairs and thresholds is None:
        return None
    rows = _Rows(delta, a)
    counts = torch.bincount(l, minlength=bins) * width
    order = rows.order
    if pairs:  # every bin edge a row crosses, the rows in table order
        sp = span[order]
        t = torch.repeat_interleave(rows.t[order], sp)
        m = torch.repeat_interleave(rows.m[order], sp)
        first = torch.cumsum(sp, 0) - sp
        k = torch.repeat_interleave(f[order] + 1 - first, sp) + torch.arange(pairs, device=dev)  # the bins entered
        # the products of a row in bins < k are those < thresholds[k]
        pos = rows.first_below(t, m, thresholds[k])
        counts.index_add_(0, k - 1, pos)
        counts.index_add_(0, k, -pos)
    low = torch.zeros((), dtype=torch.int64)
    r = order[low_mask[order]]
    if r.numel():  # x < lo as the dense path compares: in the products' dtype
        low = rows.first_below(rows.t[r], rows.m[r], torch.full(r.shape, lo, dtype=dtype, device=dev)).sum()
    high = torch.zeros((), dtype=torch.int64)
    r = order[high_mask[order]]
    if r.numel():  # x > hi: not below the next value of the dtype after hi
        above = torch.tensor(hi, dtype=dtype, device=dev).nextafter(torch.tensor(math.inf, dtype=dtype, device=dev))
        high = (width - rows.first_below(rows.t[r], rows.m[r], above.expand(r.shape))).sum()
    return counts, low, high


@functools.lru_cache(maxsize=32)
def bin_thresholds(lo: float, hi: float, bins: int, dtype: torch.dtype, device: torch.device) -> Tensor | None:
    """``[bins + 1]`` values of ``dtype`` (float32 or float64): ``T[k]`` is the smallest value
    whose :func:`bin_of` is ``>= k`` (``T[0] = -inf``, ``T[bins] = +inf``), so ``bin_of(x) < k``
    exactly when ``x < T[k]`` (``bin_of`` is monotone: rounding is). Found by bisection over the
    values of ``dtype`` between a quarter bin below and above each edge; None where a quarter bin
    is below the resolution of ``dtype`` there (the caller materialises). Cached: do not modify."""
    k = torch.arange(bins + 1, device=device)
    edges = _edge_values(lo, hi, bins, device)
    quarter = (hi - lo) / bins / 4
    below, above = _order_key((edges - quarter).to(dtype)), _order_key((edges + quarter).to(dtype))
    inner = (k > 0) & (k < bins)
    ok = (bin_of(_from_key(below, dtype), lo, hi, bins) < k) & (bin_of(_from_key(above, dtype), lo, hi, bins) >= k)
    if not bool(ok[inner].all()):
        return None
    for _ in range(70):  # keys of adjacent values differ by 1
        open_ = inner & (below + 1 < above)
        if not bool(open_.any()):
            break
        mid = (below >> 1) + (above >> 1) + (below & above & 1)  # floor((below + above) / 2), no overflow
        up = bin_of(_from_key(mid, dtype), lo, hi, bins) >= k
        above = torch.where(open_ & up, mid, above)
        below = torch.where(open_ & ~up, mid, below)
    t = _from_key(above, dtype)
    t[0], t[bins] = -math.inf, math.inf
    return t


def _order_key(t: Tensor) -> Tensor:
    """int64 keys in the order of the (finite) float32 / float64 values ``t``; adjacent values
    have adjacent keys (-0.0 just below +0.0)."""
    if t.dtype == torch.float64:
        bits = t.view(torch.int64)
        return bits ^ ((bits >> 63) & 0x7FFFFFFFFFFFFFFF)
    bits = t.view(torch.int32).long()
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _from_key(key: Tensor, dtype: torch.dtype) -> Tensor:
    """The values of ``dtype`` whose :func:`_order_key` is ``key``."""
    if dtype == torch.float64:
        return (key ^ ((key >> 63) & 0x7FFFFFFFFFFFFFFF)).view(torch.float64)
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(torch.int32).view(torch.float32)


def _edge_values(lo: float, hi: float, bins: int, device) -> Tensor:
    """``[bins + 1]`` float64 edges ``lo + (hi - lo) * k / bins`` (exactly 0 where 0 is an edge):
    where the search for each bin's first product starts."""
    edges = lo + (hi - lo) * torch.arange(bins + 1, dtype=torch.float64, device=device) / bins
    z = _affine(lo, hi, bins)[1]
    if z is not None:
        edges[int(z)] = 0.0
    return edges
