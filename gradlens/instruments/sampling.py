"""Sampled histograms: counts estimated from a random sample of parameter coordinates.

For every layer and micro-step (a *stratum*: the ``B`` samples of a micro-batch times the ``D``
entries of one parameter), ``m = max(2, ceil(fraction * D))`` coordinates ``j_1..j_m`` are drawn
uniformly, independently and with replacement, and only the entries ``g_n[j_k]`` of every sample
n are computed (``[B, m]``, from the layer's factors: ``Kernel.entries``; no ``[B, *param]``
tensor). So ``fraction * B * D`` elements are binned. With ``y_k`` the number of samples whose
entry ``j_k`` falls in bin b, the stratum's count of bin b is estimated by

    c_b = (D / m) sum_k y_k                       unbiased: E[y_k] = (1 / D) sum_j y(j),

and, the y_k being i.i.d., its variance by the unbiased

    v_b = (D^2 / m) s_b^2,    s_b^2 = (sum_k y_k^2 - (sum_k y_k)^2 / m) / (m - 1).

(For a 2D cell (p, g), y_k counts only if coordinate j_k's parameter value lies in bin p.)
Strata are independent, so a window's estimate is the sum of its strata's ``c_b`` and its
variance the sum of their ``v_b``; the record holds ``counts`` (float64 estimates) and
``stderr = sqrt(sum v_b)`` per bin. Entries known to be zero without sampling (a layer that a
micro-step skipped) are added exactly, with no variance. Drawing coordinates rather than single
elements keeps the gathers contiguous and the random draws B times fewer; the variance estimate
accounts for the samples of one coordinate being correlated.

Randomness: a private generator per draw, seeded from ``(seed, draw counter)``; the global
``torch`` random state is never touched, and the counter is part of the instrument's state
(:meth:`gradlens.Lens.state_dict`), so a resumed run continues the same stream.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from gradlens.kernels import CHUNK_ELEMENTS

__all__ = ["check_sample", "Draws", "Moments"]


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
        """``[m]`` flat coordinates in ``[0, numel)``, uniform with replacement,
        ``m = max(2, ceil(fraction * numel))``."""
        m = max(2, math.ceil(fraction * numel))
        gen = torch.Generator(device=device)
        gen.manual_seed((self.seed * 0x9E3779B1 + self.count) % (1 << 63))
        self.count += 1
        return torch.randint(numel, (m,), generator=gen, device=device)


def column_chunks(m: int, batch: int, cells: int):
    """Slices of the m coordinates whose ``[B, chunk]`` entries and ``[chunk, cells]`` tables
    stay below :data:`~gradlens.kernels.CHUNK_ELEMENTS`."""
    step = max(1, CHUNK_ELEMENTS // max(batch, cells, 1))
    for s in range(0, m, step):
        yield s, min(m, s + step)


class Moments:
    """Per cell, ``sum_k y_k`` and ``sum_k y_k^2`` over the m coordinates of one stratum."""

    def __init__(self, cells: int, device):
        self.s1 = torch.zeros(cells, dtype=torch.float64, device=device)
        self.s2 = torch.zeros(cells, dtype=torch.float64, device=device)

    def add(self, y: Tensor, cell: Tensor) -> None:
        """``y [c]`` per-coordinate counts going to the cells ``cell [c]`` (int64)."""
        y = y.to(torch.float64)
        self.s1.index_add_(0, cell, y)
        self.s2.index_add_(0, cell, y * y)

    def add_table(self, table: Tensor) -> None:
        """``table [c, cells]``: per-coordinate counts, one column per cell."""
        t = table.to(torch.float64)
        self.s1 += t.sum(0)
        self.s2 += (t * t).sum(0)

    def into(self, counts: Tensor, var: Tensor, m: int, numel: int) -> None:
        """Add the stratum's estimate ``(D / m) s1`` and variance ``(D^2 / m) s^2`` (in place)."""
        counts.add_(self.s1, alpha=numel / m)
        s2 = (self.s2 - self.s1 * self.s1 / m).clamp_(min=0.0) / (m - 1)
        var.add_(s2, alpha=float(numel) ** 2 / m)
