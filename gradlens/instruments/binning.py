"""Binning per-sample gradient elements: the rule of every histogram, and counting in one pass.

Element x falls in bin ``floor((x - lo) * bins / (hi - lo))``, clamped to ``[0, bins - 1]``
(NaN in the last bin); when 0 is an edge it is computed as ``z + floor(x * bins / (hi - lo))``
so that the sign alone decides the side of the zero edge (:func:`bin_of`).

Counting (:func:`count_1d`, :func:`count_2d`) is one ``bincount`` over a chunk of elements,
whose cost per index dominates: the 1D counts pack two elements into one index (half the
increments), the 2D ones count ``param_bin * (G + 2) + grad_bin`` in ``int16`` where it fits,
and a chunk whose elements all lie in the range skips the clamping (its bins are shifted by one
and the two bins beyond the range folded back). On the device paths (:mod:`gradlens.core.sync`) the
bins are counted by :func:`tally` without host reads.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gradlens.core.sync import device_paths
from gradlens.core.limits import DIRECT_COUNT

__all__ = ["bin_of", "count_1d", "count_2d", "tally"]


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


def tally(counts: Tensor, idx: Tensor) -> None:
    """``counts[k] += #{idx == k}`` for integer ``idx`` in ``[0, len(counts))``, in place.

    CPU: one ``bincount``. Device paths (:mod:`gradlens.core.sync`): ``bincount`` reads the largest
    index back to size its output, so the indices are counted by ``torch.histc`` over their
    integer values instead (exact: each call stays below 2**24 elements)."""
    flat = idx.reshape(-1)
    n = counts.numel()
    if not device_paths(flat):
        counts += torch.bincount(flat, minlength=n)
        return
    for part in flat.split(1 << 24):  # float32 counts: exact below 2**24 per call
        counts += torch.histc(part.float(), n, 0, n).to(torch.int64)


def _shifted_bins(x: Tensor, lo: float, hi: float, bins: int, inside: bool) -> Tensor:
    """Float bins of ``x`` plus one, in ``[0, bins + 1]``: bin_of's rule before its clamp (an
    element at ``hi``, or at ``lo``'s value in the dtype just below ``lo``, lands one beyond;
    the caller folds those back); ``inside=False`` clamps to ``[1, bins]`` (NaN in the last)."""
    s, z = _affine(lo, hi, bins)
    if z is None:
        f = torch.sub(x, lo).mul_(s).floor_().add_(1)
    else:
        f = torch.mul(x, s).floor_().add_(z + 1)
    if not inside:
        f.nan_to_num_(nan=float(bins)).clamp_(1, bins)
    return f


def _fold(h: Tensor, bins: int) -> Tensor:
    """``[..., bins]`` from shifted counts ``[..., bins + 2]``: the bins beyond each end fold
    into the end bins."""
    out = h[..., 1:bins + 1].clone()
    out[..., 0] += h[..., 0]
    out[..., -1] += h[..., bins + 1]
    return out




def count_1d(x: Tensor, lo: float, hi: float, bins: int, inside: bool = False) -> Tensor:
    """``[bins]`` int64 counts of the elements of ``x`` by :func:`bin_of`'s rule (clamped, NaN in
    the last bin); ``inside``: the caller checked that every element is finite and within
    ``[lo, hi]`` (in ``x``'s dtype), so nothing is clamped.

    CPU: beyond :data:`DIRECT_COUNT` elements, two elements per index (``(bins + 2)**2`` pair
    bins, the two marginals added), one ``bincount``. Device paths: :func:`tally` of
    :func:`bin_of`."""
    if device_paths(x):
        counts = torch.zeros(bins, dtype=torch.int64, device=x.device)
        tally(counts, bin_of(x, lo, hi, bins, torch.int32, finite=inside))
        return counts
    if x.numel() <= DIRECT_COUNT:
        return torch.bincount(bin_of(x, lo, hi, bins, torch.int32, finite=inside).reshape(-1), minlength=bins)
    nb = bins + 2
    f = _shifted_bins(x, lo, hi, bins, inside).reshape(-1)
    n = f.numel()
    if nb * nb <= 1 << 24 and n >= 2:  # pair indices exact in float32
        pairs = f[: n - n % 2].view(-1, 2)
        key = torch.add(pairs[:, 1], pairs[:, 0], alpha=nb).to(torch.int16 if nb * nb <= 1 << 15 else torch.int32)
        c = torch.bincount(key, minlength=nb * nb).view(nb, nb)
        h = c.sum(0) + c.sum(1)
        if n % 2:
            h[int(f[-1])] += 1
    else:
        h = torch.bincount(f.to(torch.int32), minlength=nb)
    return _fold(h, bins)


def count_2d(x: Tensor, offsets: Tensor, lo: float, hi: float, bins: int, pbins: int,
             inside: bool = False) -> Tensor:
    """``[pbins, bins]`` int64 joint counts of ``x [b, *param]``: entry j of every sample in row
    ``offsets[j] // (bins + 2)`` (its parameter bin; ``offsets [*param]`` of ``x``'s dtype,
    ``param_bin * (bins + 2)``), column bin_of(x) (as :func:`count_1d`; ``inside`` likewise).
    CPU only (the device paths count with :func:`tally`)."""
    s, z = _affine(lo, hi, bins)
    if inside and z is not None:  # one add: the zero edge's index with the parameter row
        f = torch.mul(x, s).floor_().add_(offsets + (z + 1))
    else:
        f = _shifted_bins(x, lo, hi, bins, inside).add_(offsets)
    nb = pbins * (bins + 2)
    idx = f.reshape(-1).to(torch.int16 if nb <= 1 << 15 else torch.int32)
    return _fold(torch.bincount(idx, minlength=nb).view(pbins, bins + 2), bins)
