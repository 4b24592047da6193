"""The gradient noise scale from gradient norms at two batch sizes (McCandlish et al. 2018, App. A).

No per-sample gradient is involved: only the squared norm of each *small* batch's gradient sum
and of the *big* batch's (the window's), which gradient accumulation (micro-batch vs window) and
data parallelism (rank-local vs all-reduced) produce anyway.

Notation (per-sample units, docs/design.md): the window has small batches k = 1..M (the micro-steps of
every rank) of sizes B_k, N = sum_k B_k samples; s_k = sum_{n in k} g_n is small batch k's
gradient sum (B_k times its mean gradient), s = sum_k s_k the window's. With g_n independent with
mean G and covariance Sigma,

    E ||s_k||^2 = B_k^2 ||G||^2 + B_k tr(Sigma),       E ||s||^2 = N^2 ||G||^2 + N tr(Sigma).

With S = sum_k ||s_k||^2, Q = sum_k B_k^2 and T = ||s||^2, so E[S] = Q ||G||^2 + N tr(Sigma),
the two linear equations give the **unbiased** estimates (any sizes B_k, needs M >= 2)

    |G|^2_est     = (T - S) / (N^2 - Q),
    tr(Sigma)_est = (N^2 S - Q T) / (N (N^2 - Q)),

(T - S = sum over pairs of samples in *different* small batches of g_n . g_m, so |G|^2_est is
the mean of g_n . g_m over those N^2 - Q ordered pairs). With equal sizes B_k = b this is the
paper's pair: |G|^2 = (N |G_big|^2 - b |G_small|^2) / (N - b) and tr(Sigma) = (|G_small|^2 -
|G_big|^2) / (1/b - 1/N), |G_small|^2 being the mean over the M small batches of their squared mean
gradient. ``B_simple = tr(Sigma)_est / |G|^2_est``; one window's ratio is noisy (and can be
negative), so, as in the paper, numerator and denominator are smoothed separately across windows
by exponential moving averages before dividing: ``b_simple_smoothed = EMA(tr) / EMA(|G|^2)``.

Two routes produce S, Q, T:

* :class:`NoiseScaleTwoBatch`, an instrument of the :class:`~gradlens.Lens`: hooks on the
  tracked parameters see each micro-step's gradient before it is added to ``p.grad`` (and, under
  DDP, before it is all-reduced), so the small batches are the micro-batches of every rank;
  T comes from the window's ``grad_sum`` (under DDP with equal batch sizes, read from DDP's
  all-reduced ``p.grad``, so the merge sends only a few scalars:
  :class:`gradlens.distributed.DDPGradRoute`).
* :class:`NoiseScaleMonitor`, on a :class:`~gradlens.GradientAccumulateOptimizer`: reads
  ``p.grad`` at every micro-step and the running window sum (a few dot products per micro-step,
  no extra memory, one host sync per window); works for any model, no Lens needed.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from gradlens.instruments.base import Instrument, WindowStats

__all__ = ["NoiseScaleTwoBatch", "NoiseScaleMonitor", "ParamGradSquares", "two_batch_estimates"]


def two_batch_estimates(S: float, Q: float, T: float, N: float) -> tuple[float, float]:
    """``(|G|^2_est, tr(Sigma)_est)`` from S = sum_k ||s_k||^2, Q = sum_k B_k^2, T = ||sum_k s_k||^2
    and N = sum_k B_k (module docstring); NaN, NaN when N^2 <= Q (a single small batch)."""
    den = N * N - Q
    if not den > 0:
        return math.nan, math.nan
    return (T - S) / den, (N * N * S - Q * T) / (N * den)


class _Smoother:
    """EMAs of |G|^2 and tr(Sigma) across windows (windows without estimates are skipped); the
    bias corrections of the two averages are equal, so their ratio needs none."""

    def __init__(self, beta: float):
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta < 1.0:
            raise ValueError(
                f"beta (the smoothing factor of the moving averages) must be a number in [0, 1), "
                f"got {beta!r}; e.g. beta=0.9 averages over about 10 windows"
            )
        self.beta = float(beta)
        self.g2 = 0.0
        self.tr = 0.0

    def update(self, g2: float, tr: float) -> float:
        if math.isfinite(g2) and math.isfinite(tr):
            b = self.beta
            self.g2 = b * self.g2 + (1 - b) * g2
            self.tr = b * self.tr + (1 - b) * tr
        return self.tr / self.g2 if self.g2 > 0 else math.nan


def _values(S: float, Q: float, T: float, N: float, M: int, smoother: _Smoother) -> dict[str, Any]:
    g2, tr = two_batch_estimates(S, Q, T, N)
    b_simple = tr / g2 if g2 > 0 and math.isfinite(tr) else math.nan
    return {
        "grad_sq": g2,
        "trace_sigma": tr,
        "b_simple": b_simple,
        "b_simple_smoothed": smoother.update(g2, tr),
        "batch_big": float(N),
        "batch_small": Q / N if N > 0 else math.nan,
        "small_batches": int(M),
    }


class NoiseScaleTwoBatch(Instrument):
    """``record["noise_scale_two_batch"]``: the gradient noise scale from two batch sizes, a dict

    * ``"grad_sq"``: unbiased |G|^2 (squared norm of the true mean per-sample gradient);
    * ``"trace_sigma"``: unbiased tr(Sigma) (total variance of one per-sample gradient);
    * ``"b_simple"``: ``trace_sigma / grad_sq`` of this window (NaN if grad_sq <= 0);
    * ``"b_simple_smoothed"``: EMA(trace_sigma) / EMA(grad_sq) over the windows so far;
    * ``"batch_big"``: N; ``"batch_small"``: sum_k B_k^2 / N (the size-weighted mean small batch,
      = b for equal sizes); ``"small_batches"``: M, the micro-batches of all ranks.

    Small batches are the micro-steps (of every rank under ``torch.distributed``), the big batch
    the window; estimates in the module docstring (exact for unequal sizes). Needs M >= 2
    (K >= 2 micro-steps, or 2+ ranks): otherwise every value is NaN and the averages skip the
    window. Cost: one dot product per tracked parameter per micro-step, no per-sample gradient.
    Same units as :class:`~gradlens.instruments.NoiseScale` (per-sample gradients), whose value
    is the per-sample estimate of the same B_simple.

    Args:
        beta: EMA factor of the smoothing across windows (default 0.9).
    """

    key = "noise_scale_two_batch"
    needs = frozenset({"grad_sum", "micro_grad_sq"})

    def __init__(self, beta: float = 0.9):
        self._smoother = _Smoother(beta)

    def __repr__(self) -> str:
        return f"NoiseScaleTwoBatch(beta={self._smoother.beta})"

    def finalize(self, stats: WindowStats, state) -> dict[str, Any]:
        return _values(
            float(stats.micro_grad_sq), stats.micro_size_sq, float(stats.grad_sum_sq_norm()),
            float(stats.num_samples), stats.micro_steps, self._smoother,
        )


class ParamGradSquares:
    """Hooks on parameters reporting ``||dL/dp||^2`` of every backward (0-d float64 tensor, no
    host sync) to ``on_sq``: the gradient of *this* backward, before it is added to ``p.grad``
    and before DDP all-reduces it. ``install()`` / ``remove()`` are idempotent."""

    def __init__(self, params: Iterable[Tensor], on_sq: Callable[[Tensor], None]):
        self.params = list(params)
        self.on_sq = on_sq
        self._handles: list = []

    def install(self) -> None:
        if not self._handles:
            self._handles = [p.register_hook(self._hook) for p in self.params if p.requires_grad]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, grad: Tensor) -> None:
        self.on_sq(sq_norm(grad))


def _sum_sq(grads: list[Tensor | None]) -> Tensor | None:
    """sum of ||g||^2 over the dense gradients given (None entries skipped) as a 0-d float64
    tensor, or None if there is none; no host sync."""
    total = None
    for g in grads:
        if g is not None:
            term = sq_norm(g)
            total = term if total is None else total + term
    return total


def sq_norm(grad: Tensor) -> Tensor:
    """||grad||^2 as a 0-d float64 tensor (sparse gradients: their values; no host sync)."""
    g = grad.detach()
    if g.is_sparse:
        g = g.coalesce().values()
    if g.dtype not in (torch.float32, torch.float64):
        g = g.float()
    g = g.reshape(-1)
    return torch.dot(g, g).double()


class NoiseScaleMonitor:
    """The two-batch noise scale of a :class:`~gradlens.GradientAccumulateOptimizer`'s windows:
    small batches = its micro-steps, big batch = the window (module docstring). Any model, no
    Lens; each micro-step costs one dot product per parameter (``||grad_k||^2``), each real
    update one more (``||s||^2`` from the window gradient the wrapper writes, before clipping)
    and one host sync.

    Example::

        opt = GradientAccumulateOptimizer(torch.optim.AdamW(model.parameters()), accum_steps=4)
        noise = NoiseScaleMonitor(opt)
        ...  loss.backward(); opt.step(num_samples=len(x)); opt.zero_grad()
        noise.values[-1]["b_simple_smoothed"]

    Every micro-step must give ``num_samples`` (B_k). Windows skipped by a GradScaler (inf/nan)
    or dropped by ``reset()`` give no value.

    Under DDP, ``p.grad`` at a micro-step is already averaged over the ranks (unless the
    micro-step ran under ``no_sync()``), so the small batch is the micro-batch of all ranks: pass
    ``ranks=R`` (every rank must use the same micro-batch sizes, as DDP's averaging assumes).
    For rank-local small batches use the Lens instrument :class:`NoiseScaleTwoBatch`.

    Args:
        optimizer: the accumulating optimizer.
        beta: EMA factor of the smoothing across windows (default 0.9).
        ranks: data-parallel ranks whose averaged gradient ``p.grad`` holds (default 1).
        callback: optional ``callback(values: dict)`` after every real update.

    Attributes:
        values: one dict per real update, keys as :class:`NoiseScaleTwoBatch`'s record value.
    """

    def __init__(
        self,
        optimizer: Any,
        *,
        beta: float = 0.9,
        ranks: int = 1,
        callback: Callable[[dict[str, Any]], None] | None = None,
    ):
        from gradlens.accumulate import GradientAccumulateOptimizer

        if not isinstance(optimizer, GradientAccumulateOptimizer):
            raise TypeError(
                "NoiseScaleMonitor(optimizer=...) needs a gradlens.GradientAccumulateOptimizer (it "
                f"sees each micro-step's gradient), got {type(optimizer).__name__}; wrap it: "
                "GradientAccumulateOptimizer(opt, accum_steps=K), or use the Lens instrument "
                "NoiseScaleTwoBatch"
            )
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
            raise ValueError(f"ranks must be an int >= 1 (data-parallel ranks), got {ranks!r}")
        if callback is not None and not callable(callback):
            raise TypeError(f"callback must be callable(values) or None, got {type(callback).__name__}")
        self.optimizer = optimizer
        self.ranks = ranks
        self.callback = callback
        self._smoother = _Smoother(beta)
        self.values: list[dict[str, Any]] = []
        self._handles = [
            optimizer.register_micro_step_hook(self._on_micro_step),
            optimizer.register_window_grad_hook(self._on_window_grad),
            optimizer.register_window_end_hook(self._on_window_end),
        ]
        self._reset()

    def _reset(self) -> None:
        self._S: Tensor | None = None
        self._T: Tensor | None = None
        self._Q = 0.0
        self._N = 0.0
        self._M = 0

    @torch.no_grad()
    def _on_micro_step(self, optimizer, num_samples: float | None) -> None:
        if num_samples is None:
            raise ValueError(
                "NoiseScaleMonitor needs each micro-step's sample count: call "
                "optimizer.step(num_samples=len(x)) on every micro-step"
            )
        b = float(num_samples) * self.ranks
        w = b if optimizer.reduction == "mean" else float(self.ranks)  # s_k = w * p.grad
        sq = _sum_sq([p.grad for group in optimizer.param_groups for p in group["params"]])
        if sq is None:
            return
        f: float | Tensor = w
        scale = getattr(optimizer, "grad_scale", None)  # set by a GradScaler for this step
        if scale is not None:
            f = w / scale.double()
        s_sq = sq * (f * f)
        self._S = s_sq if self._S is None else self._S + s_sq
        self._Q += b * b
        self._N += b
        self._M += 1

    @torch.no_grad()
    def _on_window_grad(self, optimizer) -> None:
        """T = ||s||^2, s = sum_k s_k, from the window gradient G the wrapper just wrote (before
        clipping): under "mean" G = sum_k B_k grad_k / sum_k B_k (unscaled), so s = N * G
        (N = sum_k b_k, all ranks); under "sum" s = R * G."""
        if self._S is None:
            return
        sq = _sum_sq([optimizer.window_grad(p) for group in optimizer.param_groups for p in group["params"]])
        if sq is not None:
            f = self._N if optimizer.reduction == "mean" else float(self.ranks)
            self._T = sq * (f * f)

    def _on_window_end(self, optimizer, updated: bool) -> None:
        if updated and self._S is not None:
            vals = _values(float(self._S), self._Q, float(self._T), self._N, self._M, self._smoother)
            self.values.append(vals)
            if self.callback is not None:
                self.callback(vals)
        self._reset()

    def remove(self) -> None:
        """Detach from the optimizer (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles = []
