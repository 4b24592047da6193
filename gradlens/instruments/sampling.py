"""Sampled histograms: counts estimated from a random sample of parameter coordinates.

For every layer and micro-step (a *stratum*: the ``B`` samples of a micro-batch times the ``D``
entries of one parameter), ``m`` coordinates (``fraction * D`` rounded up to a multiple of
``R = 32``) are drawn uniformly, independently and with replacement, and only the entries
``g_n[j]`` of every sample n at those coordinates are computed (``[B, m]``, from the layer's
factors: ``Kernel.entries``; no ``[B, *param]`` tensor). So about ``fraction * B * D`` elements
are binned. The m coordinates are dealt into R groups of ``L = m / R``; with ``Y_r`` the number
of (sample, coordinate) pairs of group r in bin b, the stratum's count of bin b is estimated by

    c_b = (D / m) sum_r Y_r              unbiased (each coordinate is uniform over the D),

and, the ``Y_r`` being i.i.d., its variance by the unbiased (random-groups estimator)

    v_b = (D / m)^2 R s_b^2,   s_b^2 = sum_r (Y_r - mean Y)^2 / (R - 1).

(For a 2D cell (p, g), only coordinates whose parameter value lies in bin p count.) Grouping
keeps the variance bookkeeping at ``R x bins`` numbers whatever m, and takes into account that
the samples of one coordinate are correlated. Strata are independent, so a window's estimate is
the sum of its strata's ``c_b`` and its variance the sum of their ``v_b``; the record holds
``counts`` (float64 estimates) and ``stderr = sqrt(sum v_b)`` per bin. Each stratum's ``v_b`` has
R - 1 = 31 degrees of freedom; summed over layers and micro-steps the window's is steadier.
Entries known to be zero without sampling (a layer that a micro-step skipped) are added exactly,
with no variance. Clamped counts are estimated the same way (an element exactly at ``hi``
counts as clamped there, a difference of measure zero).

Randomness: a private generator per draw, seeded from ``(seed, rank, draw counter)`` (ranks
under torch.distributed draw independently, so their estimates and variances add); the global
``torch`` random state is never touched, and the counter is part of the instrument's state
(:meth:`gradlens.Lens.state_dict`), so a resumed run continues the same stream.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from gradlens.instruments.binning import _affine, tally
from gradlens.core.limits import CHUNK_ELEMENTS
from gradlens.core.limits import SAMPLED_CHUNK_ELEMENTS

__all__ = ["GROUPS", "check_sample", "Draws", "Stratum", "estimate", "merge_strata"]

#: random groups per stratum (the degrees of freedom of its variance estimate, plus one)
GROUPS = 32


def check_sample(sample) -> float | None:
    """``None`` (exact counts) or a fraction in (0, 1)."""
    if sample is None:
        return None
    if isinstance(sample, bool) or not isinstance(sample, (int, float)) or not 0.0 < float(sample) < 1.0:
        raise ValueError(
            f"sample must be None (exact counts) or the fraction of elements to draw, "
            f"0 < sample < 1 (e.g. sample=0.01), got {sample!r}"
        )
    return float(sample)


class Draws:
    """The draw stream of one instrument: ``seed`` and a counter of draws made so far."""

    def __init__(self, seed: int):
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        self.seed = seed
        self.count = 0

    def coordinates(self, numel: int, fraction: float, device) -> Tensor:
        """``[m]`` flat coordinates in ``[0, numel)``, uniform with replacement; m is
        ``fraction * numel`` rounded up to a multiple of :data:`GROUPS`."""
        m = GROUPS * math.ceil(fraction * numel / GROUPS)
        gen = torch.Generator(device=device)
        gen.manual_seed((self.seed * 0x9E3779B1 + _rank() * 0x85EBCA6B + self.count) % (1 << 63))
        self.count += 1
        return torch.randint(numel, (m,), generator=gen, device=device)


def _rank() -> int:
    """This process's rank under torch.distributed (0 otherwise): ranks draw independent
    coordinates, so their estimates are independent and their variances add."""
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class Stratum:
    """The counts of one parameter over a window, per random group: ``table [GROUPS, cells,
    width + 2]`` of (below range, the ``width`` bins, at or above range) for ``cells`` rows
    (2D: parameter bins; 1D: one row). Every micro-step draws the same number m of
    coordinates of this parameter, so its strata share the scale D / m and their group counts
    add: one table per parameter and window, turned into estimates when the window closes."""

    def __init__(self, m: int, numel: int, cells: int, width: int, device):
        self.m, self.numel, self.cells, self.width = m, numel, cells, width
        self.table = torch.zeros(GROUPS * cells * (width + 2), dtype=torch.int64, device=device)

    def chunks(self, batch: int, budget: int = SAMPLED_CHUNK_ELEMENTS):
        """Column slices whose ``[B, c]`` entries stay below ``budget`` elements (cache-sized:
        the few passes over them stay in cache); multiples of :data:`GROUPS` so that column
        k's group is ``k % GROUPS`` in every slice."""
        step = max(GROUPS, min(budget, CHUNK_ELEMENTS) // max(batch, 1) // GROUPS * GROUPS)
        for s in range(0, self.m, step):
            yield s, min(self.m, s + step)

    def add(self, x: Tensor, lo: float, hi: float, row: Tensor | None = None) -> None:
        """Count ``x [B, c]`` (the entries of columns ``0..c-1`` of a slice; overwritten) into
        the table: bin ``floor((x - lo) * width / (hi - lo))`` as :func:`bin_of` (the sign
        decides at a zero edge), below ``lo`` and at or above ``hi`` (and NaN) apart; ``row
        [c]`` the cell row of each column (2D). Binning, clamping and the cell offset take four
        in-place passes."""
        c = x.shape[1]
        w = self.width
        s, z = _affine(lo, hi, w)
        shift = 0.0 if z is None else z  # bins are floor(x * s) + shift
        if z is None:
            x.sub_(lo)
        x.mul_(s).floor_().nan_to_num_(nan=w - shift).clamp_(-1 - shift, w - shift)
        group = torch.arange(c, device=x.device) % GROUPS
        base = group * (self.cells * (w + 2)) + (1 + int(shift))
        if row is not None:
            base = base + row * (w + 2)
        tally(self.table, x.add_(base.to(x.dtype)).int())

    def merged(self, other: "Stratum") -> "Stratum":
        out = Stratum(self.m, self.numel, self.cells, self.width, self.table.device)
        out.table = self.table + other.table.to(self.table.device)
        return out



def estimate(strata: list[Stratum]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Sum over parameters (strata of one instrument: tables of one shape) of ``(counts, var,
    low, high)``: float64 estimates ``[cells * width]`` (clamped values in the edge bins),
    their variance, and the estimated numbers below / above the range. One vectorised pass."""
    first = strata[0]
    dev = first.table.device
    t = torch.stack([st.table.to(dev) for st in strata]).to(torch.float64)
    t = t.view(len(strata), GROUPS, first.cells, first.width + 2)
    scale = torch.tensor([st.numel / st.m for st in strata], dtype=torch.float64, device=dev)
    y = t[..., 1:-1].clone()
    y[..., 0] += t[..., 0]
    y[..., -1] += t[..., -1]
    y = y.reshape(len(strata), GROUPS, -1)  # Y_r per parameter and cell
    s1 = y.sum(1)  # [S, cells * width]
    spread = (y - s1[:, None] / GROUPS).square_().sum(1) / (GROUPS - 1)
    counts = scale @ s1
    var = (scale * scale * GROUPS) @ spread
    low = scale @ t[..., 0].sum((1, 2))
    high = scale @ t[..., -1].sum((1, 2))
    return counts, var, low, high


def merge_strata(a: dict, b: dict) -> dict:
    """Union of two name -> :class:`Stratum` maps (tables of a common name add)."""
    if a is b:
        return a
    out = dict(a)
    for name, st in b.items():
        out[name] = out[name].merged(st) if name in out else st
    return out
