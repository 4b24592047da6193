"""Criteria of Cockpit's auxiliary screen: the CABS batch size (Balles et al. 2017) and the EB
early-stopping criterion (Mahsereci et al. 2017), over the window's N samples.

Both derive from the same window sums as the other gradient tests (micro-steps and ranks merge
exactly): CABS from tr(Sigma) as :class:`~gradlens.instruments.NoiseScale` defines it,
EarlyStopping from the per-coordinate variances of :class:`~gradlens.instruments.MeanGSNR`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from gradlens.instruments.base import Instrument

from gradlens.core.stats import DistParts, WindowStats
from gradlens.instruments.tests import MeanGSNR, ShiftedMoments, _trace_cov

__all__ = ["CABS", "EarlyStopping"]


def _plain_sgd(optimizer: Any) -> tuple[Any, bool]:
    """(the torch.optim.SGD doing the update, whether a GradientAccumulateOptimizer wraps it);
    raises ValueError naming why another optimizer does not fit CABS."""
    from gradlens.training.accumulate import GradientAccumulateOptimizer

    if optimizer is None:
        raise ValueError(
            "CABS() needs the learning rate of the optimizer doing the update; give the Lens "
            "its optimizer: Lens(model, [CABS(), ...], optimizer=torch.optim.SGD(...))"
        )
    wrapped = isinstance(optimizer, GradientAccumulateOptimizer)
    inner = optimizer.optimizer if wrapped else optimizer
    if type(inner) is not torch.optim.SGD:
        raise ValueError(
            f"CABS() is derived for plain SGD (theta <- theta - lr * g), got "
            f"{type(inner).__name__}: its batch size lr * tr(Sigma) / L has no meaning for "
            "adaptive or momentum methods; use torch.optim.SGD(params, lr=..., momentum=0), "
            "or NoiseScale() for a batch-size scale that needs no optimizer"
        )
    for i, group in enumerate(inner.param_groups):
        for name in ("momentum", "weight_decay"):
            if group.get(name, 0) != 0:
                raise ValueError(
                    f"CABS() is derived for plain SGD, but param_groups[{i}] has "
                    f"{name}={group[name]!r} (the step is then not -lr * g); use "
                    f"torch.optim.SGD(params, lr=..., {name}=0)"
                )
    return inner, wrapped


class CABS(Instrument):
    """``record["cabs"]``: the batch size that the CABS rule of Balles, Romero & Hennig (2017,
    eq. 22) suggests for plain SGD at this window's learning rate,

        B_CABS = lr * tr(Sigma) / L,   tr(Sigma) = sum_n ||g_n - G||^2 / (N - 1),

    in samples, with L the window's loss (the mean over its N samples), G the window's mean
    gradient and tr(Sigma) the unbiased trace of NoiseScale / NormTest (from the per-sample norms
    ``batch_l2`` and the window gradient, no materialisation). ``lr`` is read from the Lens'
    optimizer when the window closes (all its param groups must share one lr).

    Only for ``torch.optim.SGD`` without momentum and weight decay (directly or inside a
    :class:`~gradlens.GradientAccumulateOptimizer`): the Lens refuses any other optimizer when
    built, with the reason. Under a ``"sum"`` loss the step lr * sum_n g_n is a step of
    lr * N on the mean objective, so CABS uses lr * N and the mean loss L / N:
    ``lr * N^2 * tr(Sigma) / L_sum`` (with a plain SGD; through a GradientAccumulateOptimizer,
    whose step follows its own normalisation, a sum loss gives None and a meta note).
    NaN if N < 2; None with ``record.meta["cabs"]`` if L <= 0 or the lrs differ.

    Convention vs cockpit-for-pytorch's ``CABS``: cockpit uses the biased trace (1/B instead of
    1/(N - 1)) and its own ``lr`` argument; on the same window its value is (N - 1) / N times
    gradlens'.
    """

    key = "cabs"
    needs = frozenset({"batch_l2", "grad_sum"})

    def __init__(self) -> None:
        self._sgd: Any = None
        self._wrapped = False

    def __repr__(self) -> str:
        return "CABS()"

    def attach(self, params, optimizer) -> None:
        self._sgd, self._wrapped = _plain_sgd(optimizer)

    def start_window(self) -> dict[str, str]:
        return {}

    def merge(self, a, b):
        return a

    def to_buffers(self, state, ctx):
        """Nothing of its own to send: tr(Sigma) and L come from the merged window sums."""

        return DistParts()

    def finalize(self, stats: WindowStats, state: dict[str, str]) -> float | None:
        if self._sgd is None:
            raise RuntimeError("CABS() reads the Lens' optimizer; use it inside a Lens(..., optimizer=opt)")
        lrs = {float(g["lr"]) for g in self._sgd.param_groups}
        if len(lrs) != 1:
            state["note"] = f"missing: the optimizer's param groups have different lrs {sorted(lrs)}"
            return None
        lr = lrs.pop()
        n = stats.num_samples
        tr, _ = _trace_cov(stats)
        if math.isnan(tr):
            return math.nan
        loss = float(stats.loss_sum) / max(n, 1)  # the mean loss, whatever the reduction
        if stats.reduction == "sum":
            if self._wrapped:
                state["note"] = (
                    "missing: a sum loss through a GradientAccumulateOptimizer; use a mean loss"
                )
                return None
            lr = lr * n  # lr * sum_n g_n = (lr N) * G
        if not loss > 0:
            state["note"] = f"missing: the window's loss is {loss!r}; CABS divides by a positive loss"
            return None
        return lr * tr / loss

    def meta(self, state: dict[str, str]) -> dict[str, Any]:
        return {"cabs": state["note"]} if state.get("note") else {}


class EarlyStopping(MeanGSNR):
    """``record["early_stopping"]``: the evidence-based (EB) criterion of Mahsereci, Balles,
    Lassner & Hennig (2017, eq. 7), over the window's N samples,

        EB = 1 - (N / D) sum_j G_j^2 / var_j   (training should stop when EB > 0),

    with G_j the window's mean gradient and var_j the unbiased per-sample variance of coordinate
    j, over the D tracked coordinates with var_j > 0: exactly MeanGSNR's convention (shifted
    sums, round-off floor), so EB = 1 - N * record["mean_gsnr"]. NaN if N < 2 or no coordinate
    varies. Materialises per-sample gradients (one layer and slice at a time, like MeanGSNR).

    Convention vs cockpit-for-pytorch's ``EarlyStopping``: cockpit divides by var_j + 1e-5
    (unbiased var_j) and averages over all D coordinates.
    """

    key = "early_stopping"

    def finalize(self, stats: WindowStats, state: ShiftedMoments) -> float:
        gsnr = super().finalize(stats, state)
        return 1.0 - stats.num_samples * gsnr
