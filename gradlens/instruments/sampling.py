"""Sampled histograms: counts estimated from a random sample of per-sample gradient entries.

For every layer and micro-step (a *stratum*: ``B`` samples times the ``D`` entries of one
parameter, ``T = B * D`` elements), ``m = max(2, ceil(fraction * T))`` pairs ``(n, j)`` are drawn
uniformly, independently and with replacement, and only those entries ``g_n[j]`` are computed
(from the layer's factors, see ``Kernel.elements``; no ``[B, *param]`` tensor). If ``h_b`` of the
``m`` draws fall in bin ``b``, the stratum's count of bin ``b`` is estimated by

    c_b = T h_b / m,             unbiased: E[h_b] = m p_b with p_b the bin's share of the T,

and its variance ``T^2 p_b (1 - p_b) / m`` by the unbiased

    v_b = T^2 h_b (m - h_b) / (m^2 (m - 1)).

Strata are independent, so a window's estimate is the sum of its strata's ``c_b`` and its
variance the sum of their ``v_b``; the record holds ``counts`` (float64 estimates) and
``stderr = sqrt(sum v_b)`` per bin. Entries known to be zero without sampling (a layer that a
micro-step skipped) are added exactly, with no variance. The cost is ``O(m)`` per stratum for
Linear, transformers' Conv1D, Conv2d and Embedding weights (times the positions summed over for
sequence layers and convolutions); other layers materialise their (small) per-sample gradients
and gather the drawn entries.

Randomness: a private generator per draw, seeded from ``(seed, draw counter)``; the global
``torch`` random state is never touched, and the counter is part of the instrument's state
(:meth:`gradlens.Lens.state_dict`), so a resumed run continues the same stream.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["check_sample", "Draws", "add_estimate"]


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

    def draw(self, batch: int, numel: int, fraction: float, device) -> tuple[Tensor, Tensor, int, int]:
        """``(n [m], j [m], m, T)``: m uniform pairs, sample n in [0, batch), flat entry j in
        [0, numel), with replacement."""
        total = batch * numel
        m = max(2, math.ceil(fraction * total))
        gen = torch.Generator(device=device)
        gen.manual_seed((self.seed * 0x9E3779B1 + self.count) % (1 << 63))
        self.count += 1
        flat = torch.randint(total, (m,), generator=gen, device=device)
        return flat // numel, flat % numel, m, total


def add_estimate(counts: Tensor, var: Tensor, h: Tensor, m: int, total: int) -> None:
    """Add one stratum's unbiased estimate ``T h / m`` to ``counts`` and its variance estimate
    ``T^2 h (m - h) / (m^2 (m - 1))`` to ``var`` (float64, in place)."""
    h = h.to(torch.float64)
    counts.add_(h, alpha=total / m)
    var.add_(h * (m - h), alpha=float(total) ** 2 / (float(m) ** 2 * (m - 1)))
