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
    ``searchsorted`` over the samples' rows, the queries of each sample padded to the longest."""
    b, w = asc.shape
    counts = torch.bincount(sample, minlength=b)
    widest = int(counts.max())
    if b * widest > 4 * sample.numel() + 4096:  # very uneven: one search per sample
        out = torch.empty_like(sample)
        first = 0
        for n, c in enumerate(counts.tolist()):
            if c:
                out[first:first + c] = torch.searchsorted(asc[n], t[first:first + c])
                first += c
        return out
    slot = torch.arange(sample.numel(), device=sample.device) - (torch.cumsum(counts, 0) - counts)[sample]
    at = sample * widest + slot  # flat positions in the padded [B, widest] queries
    padded = asc.new_full((b * widest,), math.inf)
    padded[at] = t
    return torch.searchsorted(asc, padded.view(b, widest)).view(-1)[at]


class _Rows:
    """The rows ``r = n * O + i`` of the products ``delta[n, i] * a[n, j]``, each in ascending
    order of its products: rank j of row r is ``asc[n, j]`` for ``delta >= 0`` and
    ``asc[n, I - 1 - j]`` for ``delta < 0``."""

    def __init__(self, delta: Tensor, a: Tensor):
        b, o = delta.shape
        self.width = a.shape[1]
        self.steps = max(1, math.ceil(math.log2(self.width + 1)))
        self.asc = a.sort(dim=1).values  # [B, I]
        self.flat = self.asc.reshape(-1)
        self.d = delta.reshape(-1)
        self.o = o
        self._runs = None

    def first_below(self, rows: Tensor, limit: Tensor) -> Tensor:
        """For each query q (rows ``rows`` ascending, ``limit`` of the products' dtype, one per
        query), how many products of row ``rows[q]`` are ``< limit[q]``: the first rank j in
        [0, I] whose product is not below it.

        The rank is first read from the sorted inputs (limit / delta by ``searchsorted``: exact
        up to the rounding of that quotient and of the products), then moved over runs of equal
        inputs until the product of rank j - 1 is below the limit and that of rank j is not (the
        very float products the materialised path forms); the few queries that do not settle
        within 4 moves get a binary search over the products."""
        w, top = self.width, self.width - 1
        n = torch.div(rows, self.o, rounding_mode="floor")
        d = self.d[rows]
        neg = d < 0
        base = n * w

        def below(j: Tensor, q: Tensor | None = None) -> Tensor:  # is the product of rank j < limit?
            if q is None:
                return d * self.flat[base + torch.where(neg, top - j, j)] < limit
            return d[q] * self.flat[base[q] + torch.where(neg[q], top - j, j)] < limit[q]

        found = _below(self.asc, n, (limit.double() / d.double()).to(self.asc.dtype))
        j = torch.where(neg, w - found, found)  # ranks whose product lies below the limit
        zero = d == 0  # every product is +-0: all ranks or none lie below the limit
        if bool(zero.any()):
            j = torch.where(zero, torch.where(below(torch.zeros_like(j)), w, 0), j)
        if self._runs is None:
            self._runs = _runs(self.asc)
        start, end = (t.reshape(-1) for t in self._runs)

        def wrong(j):  # rank j - 1 is not below (too far), or rank j is (not far enough)
            left = (j > 0) & ~below((j - 1).clamp(min=0))
            right = (j < w) & below(j.clamp(max=top))
            return left, right

        for _ in range(4):
            left, right = wrong(j)
            if not bool((left | right).any()):
                return j
            # jump over the run of equal inputs at the rank in question (ranks reversed if delta < 0)
            k = torch.where(left, j - 1, j).clamp(0, top)
            col = base + torch.where(neg, top - k, k)
            s, e = start[col], end[col]
            j = torch.where(left, torch.where(neg, w - e, s), torch.where(right, torch.where(neg, w - s, e), j))
        left, right = wrong(j)
        bad = (left | right).nonzero().squeeze(1)
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
        lo, hi, bins: the histogram (clamping rule of :class:`~gradlens.records.Hist1d`).
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
    low_rows = (vmin < lo).nonzero().squeeze(1)
    high_rows = (vmax > hi).nonzero().squeeze(1)
    if pairs + low_rows.numel() + high_rows.numel() > max_cost * delta.numel() * width:
        return None
    rows = _Rows(delta, a)
    counts = torch.bincount(l, minlength=bins) * width
    dtype, dev = rows.asc.dtype, delta.device
    thresholds = bin_thresholds(lo, hi, bins, dtype, dev) if pairs else None
    if pairs and thresholds is None:
        return None
    if pairs:
        rows_all = torch.arange(rows.d.numel(), device=dev)
        r = torch.repeat_interleave(rows_all, span)
        first = torch.cumsum(span, 0) - span
        k = f[r] + 1 + (torch.arange(pairs, device=dev) - first[r])  # the bins each row enters
        # the products of row r in bins < k are those < thresholds[k]
        pos = rows.first_below(r, thresholds[k])
        counts.index_add_(0, k - 1, pos)
        counts.index_add_(0, k, -pos)
    low = torch.zeros((), dtype=torch.int64)
    if low_rows.numel():  # x < lo as the dense path compares: in the products' dtype
        low = rows.first_below(low_rows, torch.full(low_rows.shape, lo, dtype=dtype, device=dev)).sum()
    high = torch.zeros((), dtype=torch.int64)
    if high_rows.numel():  # x > hi: not below the next value of the dtype after hi
        above = torch.tensor(hi, dtype=dtype, device=dev).nextafter(torch.tensor(math.inf, dtype=dtype, device=dev))
        high = (width - rows.first_below(high_rows, above.expand(high_rows.shape))).sum()
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
