"""Exact 1D histograms of rank-one per-sample gradients without materialising them.

For a Linear layer without a sequence axis, g_n = delta_n a_n^T: row i of sample n holds the
values delta_ni * a_nj over j. Rounding is monotone, so with a_n sorted, the products of one row
are sorted too (reversed when delta_ni < 0), and so is their bin
``floor((x - lo) * bins / (hi - lo))``. A row that spans the bins f..l therefore needs only
l - f binary searches over j (each evaluating the very same float products the materialised path
would bin), instead of touching all d_in elements. Most rows span one or two bins, so the cost
drops from O(B d_out d_in) to about O(B d_out log d_in); rows that span many bins make the caller
fall back to the materialised path (see :func:`outer_hist1d`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from gradlens.sync import device_paths

__all__ = ["bin_of", "extremes_inside", "outer_hist1d", "row_extremes", "tally"]


def row_extremes(delta: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
    """``[B * O]`` min and max over j of delta[n, i] * a[n, j] (the same float products)."""
    amin, amax = a.amin(1, keepdim=True), a.amax(1, keepdim=True)
    pos = delta >= 0
    vmin = torch.where(pos, delta * amin, delta * amax).reshape(-1)
    vmax = torch.where(pos, delta * amax, delta * amin).reshape(-1)
    return vmin, vmax


def _affine(lo: float, hi: float, bins: int) -> tuple[float, float | None]:
    """``(s, z)``: bins per unit ``s = bins / (hi - lo)`` and, when 0 is an edge of the range,
    its index ``z = -lo * s`` (an integer), else None."""
    s = bins / (hi - lo)
    z = -lo * s
    if lo <= 0.0 <= hi and abs(z - round(z)) <= 1e-9 * max(1.0, abs(z)):
        return s, float(round(z))
    return s, None


def bin_of(x: Tensor, lo: float, hi: float, bins: int, dtype: torch.dtype = torch.int64,
           finite: bool = False) -> Tensor:
    """Integer (``dtype``) bins by the documented rule ``floor((x - lo) * bins / (hi - lo))``, clamped to
    ``[0, bins - 1]`` (NaN in the last bin; ``finite=True``: the caller knows there is none).
    When 0 is an edge it is computed as ``z + floor(x * bins / (hi - lo))``, the same number
    without the rounding of ``x - lo``: the sign of x alone decides the side of the zero edge (a
    tiny negative value is never rounded into the bin right of zero)."""
    s, z = _affine(lo, hi, bins)
    if z is None:
        idx = torch.mul(x - lo, s).floor_()
    else:
        idx = torch.mul(x, s).floor_().add_(z)
    if not finite:
        idx.nan_to_num_(nan=float(bins))
    return idx.clamp_(0, bins - 1).to(dtype)


def extremes_inside(x: Tensor, lo: float, hi: float) -> tuple[Tensor, Tensor] | None:
    """``(min, max)`` of ``x`` when every element lies in ``[lo, hi]`` (so none is clamped and
    none is NaN), else None: one pass that spares the histograms' three exact comparisons per
    element (below, above, NaN) in the common case. It reads the answer on the host, so it is
    CPU-only: None on the device paths (:mod:`gradlens.sync`) and for empty ``x``."""
    if x.numel() == 0 or device_paths(x):
        return None
    mn, mx = torch.aminmax(x)
    return (mn, mx) if bool(mn >= lo) and bool(mx <= hi) else None


def tally(counts: Tensor, idx: Tensor) -> None:
    """``counts[k] += #{idx == k}`` for integer ``idx`` in ``[0, len(counts))``, in place.

    CPU: one ``bincount``. Device paths (:mod:`gradlens.sync`): ``bincount`` reads the largest
    index back to size its output, so the indices are counted by ``torch.histc`` over their
    integer values instead (exact: each call stays below 2**24 elements)."""
    flat = idx.reshape(-1)
    n = counts.numel()
    if not device_paths(flat):
        counts += torch.bincount(flat, minlength=n)
        return
    for part in flat.split(1 << 24):  # float32 counts: exact below 2**24 per call
        counts += torch.histc(part.float(), n, 0, n).to(torch.int64)


def _first_false(pred, rows: Tensor, width: int, steps: int, start: Tensor | None = None) -> Tensor:
    """For each row, the first rank j in [0, width] where the monotone ``pred(rows, j)`` is False."""
    lo_j = torch.zeros_like(rows) if start is None else start
    hi_j = torch.full_like(rows, width)
    for _ in range(steps):
        mid = (lo_j + hi_j) // 2
        true = pred(rows, mid.clamp(max=width - 1)) & (mid < width)
        lo_j = torch.where(true, mid + 1, lo_j)
        hi_j = torch.where(true, hi_j, mid)
    return lo_j


def outer_hist1d(
    delta: Tensor, a: Tensor, lo: float, hi: float, bins: int, max_cost: float = 0.125
) -> tuple[Tensor, Tensor, Tensor] | None:
    """Histogram of every product ``delta[n, i] * a[n, j]``.

    Args:
        delta: ``[B, O]`` per-sample output gradients (finite).
        a: ``[B, I]`` layer inputs (finite).
        lo, hi, bins: the histogram (clamping rule of :class:`~gradlens.records.Hist1d`).
        max_cost: give up (return None) when the searches would touch more than this fraction
            of the ``B * O * I`` elements, or when a sample has fewer than 2 log2(I) rows (the
            sort would not pay off); the caller then materialises.

    Returns:
        ``(counts [bins] int64 with the clamped values included, low, high)`` (0-d int64), or None.
    """
    b, o = delta.shape
    width = a.shape[1]
    steps = max(1, math.ceil(math.log2(width + 1)))
    if o < 2 * steps:  # too few rows per sample to pay for sorting a_n: materialise instead
        return None
    asc = a.sort(dim=1).values  # [B, I]
    d = delta.reshape(-1)  # row r = n * O + i
    sample = torch.arange(b, device=d.device).repeat_interleave(o)
    neg = d < 0
    top = width - 1

    def value(rows: Tensor, j: Tensor) -> Tensor:  # rank j of row's ascending products
        return d[rows] * asc[sample[rows], torch.where(neg[rows], top - j, j)]

    rows_all = torch.arange(d.numel(), device=d.device)
    v_first = value(rows_all, torch.zeros_like(rows_all))
    v_last = value(rows_all, torch.full_like(rows_all, top))
    f, l = bin_of(v_first, lo, hi, bins), bin_of(v_last, lo, hi, bins)
    span = l - f
    pairs = int(span.sum())
    if pairs * steps > max_cost * d.numel() * width:
        return None
    counts = torch.bincount(l, minlength=bins) * width
    if pairs:
        rows = torch.repeat_interleave(rows_all, span)
        first = torch.cumsum(span, 0) - span
        k = f[rows] + 1 + (torch.arange(pairs, device=d.device) - first[rows])
        pos = _first_false(lambda r, j: bin_of(value(r, j), lo, hi, bins) < k, rows, width, steps)
        counts.index_add_(0, k - 1, pos)
        counts.index_add_(0, k, -pos)
    low = torch.zeros((), dtype=torch.int64)
    rows = (v_first < lo).nonzero().squeeze(1)
    if rows.numel():
        low = _first_false(lambda r, j: value(r, j) < lo, rows, width, steps).sum()
    high = torch.zeros((), dtype=torch.int64)
    rows = (v_last > hi).nonzero().squeeze(1)
    if rows.numel():
        high = (width - _first_false(lambda r, j: value(r, j) <= hi, rows, width, steps)).sum()
    return counts, low, high
