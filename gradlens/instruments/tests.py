"""Derived statistics of the window's per-sample gradients: norm test, mean GSNR, noise scale.

Notation: N samples, per-sample gradients g_n, sample mean G = (1/N) sum_n g_n, over all tracked
parameters. All three are scale-free in the loss reduction (they use per-sample units).

Variances that cancel. A variance from raw sums, (sum g^2 - N G^2) / (N - 1), subtracts two
nearly equal numbers when the spread is small next to the mean: for equal per-sample gradients it
leaves rounding noise (1e-21 instead of 0 in float64, far more in float32) and a GSNR of 1e15.

- :class:`MeanGSNR` keeps **shifted sums** per coordinate: with c the first sample's gradient of
  the window, S1 = sum_n (g_n - c) and S2 = sum_n (g_n - c)^2, so var = (S2 - S1^2 / N) / (N - 1)
  is exactly 0 for equal gradients and loses only eps * var to rounding otherwise (float32 is
  fine). The states merge exactly across micro-steps and ranks (a change of shift is a closed
  formula). It materialises per-sample gradients (like the histograms).
- :class:`NormTest` and :class:`NoiseScale` need only tr(Sigma), from the per-sample norms and
  the window gradient (no materialisation). Their one-pass trace
  T = sum_n ||g_n||^2 - N ||G||^2 has a rounding error below ``8 N eps sum_n ||g_n||^2`` (eps of
  the accumulation dtype); a T below that bound cannot be told from 0 and is reported as 0
  (so equal gradients give exactly 0). ``per_sample=True`` computes tr(Sigma) from the shifted
  sums instead (exact for any spread, at the cost of materialising).

One N per window: a layer that some micro-steps skip (a branch taken only for some micro-batches)
has g_n = 0 for their samples, and all three count those zeros (:meth:`ShiftedMoments.fill_zeros`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from gradlens.instruments.base import Instrument

from gradlens.core.stats import DistParts, WindowStats
from gradlens.core.state_checks import check_state
from gradlens.core.param_shapes import full_shape

__all__ = ["NormTest", "MeanGSNR", "NoiseScale", "ShiftedMoments"]


@dataclass
class ShiftedMoments:
    """Per-coordinate moments of one window's per-sample gradients about a shift, mergeable.

    For each parameter name: ``count`` samples, ``shift`` c ``[*param]`` (the first sample
    seen), ``s1`` = sum_n (g_n - c), ``s2`` = sum_n (g_n - c)^2 (``[*param]``, float32 or wider).
    Merging two states moves the second to the first's shift (exact algebra, no cancellation
    beyond the shifts' difference) and adds.
    """

    count: dict[str, int] = field(default_factory=dict)
    shift: dict[str, Tensor] = field(default_factory=dict)
    s1: dict[str, Tensor] = field(default_factory=dict)
    s2: dict[str, Tensor] = field(default_factory=dict)

    def update(self, name: str, grad_batch: Tensor) -> None:
        """Fold ``grad_batch [b, *param]`` (per-sample units) into parameter ``name``."""
        g = grad_batch.detach()
        dtype = torch.promote_types(g.dtype, torch.float32)
        g = g.to(dtype)
        if name not in self.shift:
            self.shift[name] = g[0].clone()
            self.count[name] = 0
            self.s1[name] = torch.zeros_like(g[0])
            self.s2[name] = torch.zeros_like(g[0])
        centred = g - self.shift[name]
        self.s1[name] += centred.sum(0)
        self.s2[name] += centred.square().sum(0)
        self.count[name] += g.shape[0]

    def merge(self, other: "ShiftedMoments") -> "ShiftedMoments":
        for name, n in other.count.items():
            if name not in self.count:
                self.count[name], self.shift[name] = n, other.shift[name]
                self.s1[name], self.s2[name] = other.s1[name], other.s2[name]
                continue
            # other's sums about c' -> about c: with e = c' - c,
            # sum (g - c) = s1' + n e,  sum (g - c)^2 = s2' + 2 e s1' + n e^2
            e = other.shift[name] - self.shift[name]
            self.s1[name] = self.s1[name] + other.s1[name] + n * e
            self.s2[name] = self.s2[name] + other.s2[name] + 2 * e * other.s1[name] + n * e * e
            self.count[name] += n
        return self

    def fill_zeros(self, num_samples: int) -> "ShiftedMoments":
        """Count the samples of the window that never reached a parameter (a layer some
        micro-steps skip) as exact zeros: every parameter then has ``num_samples`` samples,
        the window's one N. With e = -c: ``s1 += m e``, ``s2 += m e^2`` for the m missing."""
        for name, n in self.count.items():
            missing = num_samples - n
            if missing > 0:
                c = self.shift[name]
                self.s1[name] = self.s1[name] - missing * c
                self.s2[name] = self.s2[name] + missing * c * c
                self.count[name] = num_samples
        return self

    def restrict(self, names) -> "ShiftedMoments":
        """The moments of the parameters ``names`` only (shared tensors, no copy)."""
        keep = [q for q in self.count if q in set(names)]
        return ShiftedMoments({q: self.count[q] for q in keep}, {q: self.shift[q] for q in keep},
                              {q: self.s1[q] for q in keep}, {q: self.s2[q] for q in keep})

    def mean_var(self, name: str) -> tuple[Tensor, Tensor]:
        """(G, unbiased var) ``[*param]`` float64 of parameter ``name`` (var NaN if N < 2)."""
        n = self.count[name]
        s1, s2 = self.s1[name].double(), self.s2[name].double()
        mean = self.shift[name].double() + s1 / n
        if n < 2:
            return mean, torch.full_like(mean, math.nan)
        var = ((s2 - s1.square() / n) / (n - 1)).clamp_min(0)
        return mean, var


def _trace_cov(stats: WindowStats) -> tuple[float, float]:
    """(tr(Sigma) unbiased, ||G||^2): tr(Sigma) = (sum_n ||g_n||^2 - N ||G||^2) / (N - 1),
    with a difference below its rounding bound reported as 0 (see the module docstring)."""
    n = stats.num_samples
    g2 = float(stats.mean_grad_sq_norm())
    if n < 2:
        return math.nan, g2
    memo = stats.__dict__.setdefault("_memo", {})
    if "l2_total" not in memo:
        memo["l2_total"] = float(stats.batch_l2_all().double().sum())
    total = memo["l2_total"]
    eps = max(
        (torch.finfo(s.dtype).eps for s in stats.grad_sum.values()), default=torch.finfo(torch.float64).eps
    )
    diff = total - n * g2
    if diff <= 8 * n * eps * total:
        diff = 0.0
    return diff / (n - 1), g2


def _trace_shifted(moments: ShiftedMoments, n: int) -> tuple[float, float]:
    """(tr(Sigma), ||G||^2) from shifted sums over the window's ``n`` samples (a parameter
    that some micro-steps skipped counts their samples as zeros)."""
    moments.fill_zeros(n)
    tr, g2 = 0.0, 0.0
    for name in moments.count:
        mean, var = moments.mean_var(name)
        tr += float(var.sum())
        g2 += float(mean.square().sum())
    return (tr if n >= 2 else math.nan), g2


class _TraceInstrument(Instrument):
    per_group = True

    def group_state(self, state, names):
        return state.restrict(names) if self.per_sample else None

    def __init__(self, per_sample: bool = False):
        if not isinstance(per_sample, bool):
            raise TypeError(f"per_sample must be True or False, got {per_sample!r}")
        self.per_sample = per_sample
        if per_sample:
            self.needs = frozenset({"per_sample"})

    def __repr__(self) -> str:
        return f"{type(self).__name__}(per_sample={self.per_sample})"

    def start_window(self):
        return ShiftedMoments() if self.per_sample else None

    def update(self, state, name, param, grad_batch):
        state.update(name, grad_batch)

    def merge(self, a, b):
        return a.merge(b) if self.per_sample else a

    def _trace(self, stats: WindowStats, state) -> tuple[float, float, int]:
        if self.per_sample:
            tr, g2 = _trace_shifted(state, stats.num_samples)
            return tr, g2, stats.num_samples
        tr, g2 = _trace_cov(stats)
        return tr, g2, stats.num_samples

    # ---- checkpoints (gradlens.lens.state) ----------------------------------------------------
    def state_dict(self) -> dict:
        """``per_sample`` (checked on load: it decides the window state); nothing else is kept
        between windows."""
        return {"per_sample": self.per_sample}

    def load_state_dict(self, state: dict) -> None:
        check_state(self, state, same={"per_sample": self.per_sample})


class NormTest(_TraceInstrument):
    """``record["norm_test"]``: the smallest theta for which the norm test of Byrd et al. (2012)
    / Bollapragada et al. (2018) holds for this window:

        theta = sqrt( tr(Sigma) / N ) / ||G||,   tr(Sigma) = sum_n ||g_n - G||^2 / (N - 1)

    (the estimated standard deviation of the mean gradient relative to its norm). NaN if N < 2.
    ``per_sample=True``: tr(Sigma) from shifted sums (materialises; see the module docstring).
    """

    key = "norm_test"
    needs = frozenset({"batch_l2", "grad_sum"})

    def finalize(self, stats: WindowStats, state):
        tr, g2, n = self._trace(stats, state)
        if math.isnan(tr):
            return math.nan
        return math.sqrt(max(tr, 0.0) / n) / math.sqrt(g2) if g2 > 0 else math.nan


class NoiseScale(_TraceInstrument):
    """``record["noise_scale"]``: the simple gradient noise scale of McCandlish et al. (2018),

        B_simple = tr(Sigma) / ||G||^2,   tr(Sigma) = sum_n ||g_n - G||^2 / (N - 1)

    with tr(Sigma) the unbiased estimate and ||G||^2 the squared norm of the window's mean
    gradient. NaN if N < 2 or G = 0. ``per_sample=True``: tr(Sigma) from shifted sums.
    """

    key = "noise_scale"
    needs = frozenset({"batch_l2", "grad_sum"})

    def finalize(self, stats: WindowStats, state):
        tr, g2, _ = self._trace(stats, state)
        return tr / g2 if g2 > 0 else math.nan


class MeanGSNR(Instrument):
    """``record["mean_gsnr"]``: the mean gradient signal-to-noise ratio (Liu et al. 2020),

        GSNR_j = G_j^2 / var_j,   var_j = sum_n (g_nj - G_j)^2 / (N - 1)  (unbiased),

    averaged over the tracked coordinates j with var_j > 0: coordinates whose per-sample
    gradients are all equal carry no noise and are left out (exactly: the variance comes from
    shifted sums, see the module docstring), and so are variances below the round-off level
    of the window's largest (var_j <= eps * max_j var_j, eps of the accumulation dtype: the
    gradient of a key bias under softmax is 0 up to rounding). NaN if N < 2 or no coordinate
    varies.
    Materialises per-sample gradients (one layer and slice at a time, like GradHist1d).

    Convention vs cockpit-for-pytorch's ``MeanGSNR``: cockpit divides by the *biased* variance
    (1/N) plus ``epsilon=1e-5`` and averages over *all* coordinates; gradlens uses the unbiased
    variance, no epsilon, and leaves zero-variance coordinates out. On the same gradients,
    cockpit's value is mean_j G_j^2 / ((N-1)/N var_j + 1e-5) over all j.
    """

    key = "mean_gsnr"
    needs = frozenset({"per_sample"})
    per_group = True

    def group_state(self, state: ShiftedMoments, names) -> ShiftedMoments:
        """The group's coordinates."""
        return state.restrict(names)

    def finalize_group(self, stats: WindowStats, state: ShiftedMoments, names):
        """The mean GSNR over the group's coordinates, with the round-off floor of the whole
        window (its largest variance over every tracked coordinate, as for the total): a group
        whose variances are all round-off (a bias before a norm) gives NaN, not noise."""
        return self._mean_gsnr(stats, state, self.group_state(state, names))

    def start_window(self):
        return ShiftedMoments()

    def update(self, state: ShiftedMoments, name, param, grad_batch):
        state.update(name, grad_batch)

    def merge(self, a: ShiftedMoments, b: ShiftedMoments) -> ShiftedMoments:
        return a.merge(b)

    def to_buffers(self, state: ShiftedMoments, ctx):
        """Across ranks: each rank's (shift, s1, s2) per parameter are gathered and merged about
        one shift (exact, like micro-steps); the counts travel in the per-rank row."""
        counts, pieces = [], []
        for q, p in ctx.params.items():
            if q in state.count:
                counts.append(float(state.count[q]))
                pieces.append(torch.stack([state.shift[q], state.s1[q], state.s2[q]]).double().reshape(3, -1))
            else:
                counts.append(0.0)
                pieces.append(torch.zeros(3, 0, dtype=torch.float64))
        return DistParts(per_rank=[torch.tensor(counts, dtype=torch.float64)], pieces=pieces)

    def from_buffers(self, state: ShiftedMoments, ctx, sums, per_rank, pieces) -> ShiftedMoments:
        rows = per_rank[0]  # [R, P]
        merged = ShiftedMoments()
        for r in range(rows.shape[0]):
            part = ShiftedMoments()
            for i, (q, p) in enumerate(ctx.params.items()):
                n = int(round(float(rows[r, i])))
                if n == 0:
                    continue
                block = pieces[i][r].reshape(3, *full_shape(p))
                part.count[q], part.shift[q], part.s1[q], part.s2[q] = n, block[0], block[1], block[2]
            merged = merged.merge(part)
        return merged

    def finalize(self, stats: WindowStats, state: ShiftedMoments):
        return self._mean_gsnr(stats, state, state)

    @staticmethod
    def _mean_gsnr(stats: WindowStats, state: ShiftedMoments, part: ShiftedMoments) -> float:
        """The mean over the coordinates of ``part`` (``state`` or a group of it), with the
        round-off floor of the whole window ``state``."""
        n = stats.num_samples
        if n < 2:
            return math.nan
        total, count = 0.0, 0
        state.fill_zeros(n)  # samples that skipped a layer: g_n = 0 there, one N per window
        part.fill_zeros(n)
        if not state.count:
            return math.nan
        moments = [part.mean_var(name) for name in part.count]
        # variances below the round-off level of the window's largest one are zero: e.g. a
        # key bias under softmax, or a bias before a norm, whose exact gradient is 0. The floor
        # is kept on the state for the groups that follow (keyed by the samples it has seen)
        seen = (len(state.count), sum(state.count.values()))
        cached = state.__dict__.get("_gsnr_floor")
        if cached is not None and cached[0] == seen:
            floor = cached[1]
        else:
            eps = max(torch.finfo(state.s2[name].dtype).eps for name in state.count)
            vmax = [float(var.max()) for _, var in moments] if part is state else [
                float(state.mean_var(q)[1].max()) for q in state.count]
            floor = eps * max(vmax)
            state.__dict__["_gsnr_floor"] = (seen, floor)
        for mean, var in moments:
            ok = var > floor
            total += float((mean[ok].square() / var[ok]).sum())
            count += int(ok.sum())
        return total / count if count else math.nan
