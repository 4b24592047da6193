"""Norm-type instruments: per-sample squared norms, sums of squares, the gradient norm.

None of them materialises per-sample gradients of Linear layers (factor identities, see
:mod:`gradlens.kernels`).
"""

from __future__ import annotations

import math
from typing import Callable, Mapping

import torch
import torch.distributed as dist
from torch import Tensor

from gradlens.compat import tensor_version
from gradlens.core.sq_norms import sum_sq
from gradlens.core.stats import WindowStats
from gradlens.instruments.base import Instrument
from gradlens.training.accum_optimizer import GradientAccumulateOptimizer

__all__ = ["BatchL2", "SumGradSquared", "GradNorm"]


class BatchL2(Instrument):
    """``record["batch_l2"]``: Tensor ``[N]`` float64, ||g_n||^2 summed over tracked parameters.

    Samples are in the order the micro-steps saw them; micro-steps concatenate.
    """

    key = "batch_l2"
    needs = frozenset({"batch_l2"})
    per_group = True

    def finalize(self, stats: WindowStats, state):
        return stats.batch_l2_all().double().cpu()


class SumGradSquared(Instrument):
    """``record["sum_grad_squared"]``: dict parameter name -> ``[*param]`` (CPU, in the
    accumulation dtype: float32 or wider), sum_n g_n * g_n over the window's N samples
    (micro-steps add)."""

    key = "sum_grad_squared"
    needs = frozenset({"sum_grad_squared"})
    per_group = True

    def finalize(self, stats: WindowStats, state):
        return {k: v.detach().cpu() for k, v in stats.sum_grad_squared.items()}


class GradNorm(Instrument):
    """``record["grad_norm"]``: float, ||g|| for the window gradient g = (1/N) sum_n g_n under a
    mean loss, sum_n g_n under a sum loss (micro-steps add sum_n g_n; N is the window's).

    Args:
        source: where sum_n g_n comes from. ``"sums"`` (default): the capture adds each
            micro-step's sum_n g_n into a window sum of its own (4 bytes per tracked float32
            parameter element, kept for the window). ``"p.grad"``: read from ``p.grad`` as the
            captured backwards leave it, no tensor of its own: when every micro-step of the
            window has the same per-sample scale c (equal micro-batches under a mean loss, any
            under a sum, the same loss multiplier), ``p.grad`` was None or zero when the
            window's first captured backward started and nothing changed it between the
            captured backwards, sum_n g_n = c * p.grad (float32 or wider) exactly, and
            ||sum_n g_n||^2 = c^2 ||p.grad||^2 is taken at the end of each captured backward
            (so clipping or unscaling before the update changes nothing). A window that breaks
            one of these gets ``record["grad_norm"] = None`` and ``record.meta["grad_norm"]``
            names what broke (gradlens cannot see them early enough to keep its own sum). The
            value is the gradient of what was backpropagated: a regulariser added to the loss
            outside the model's forward is in it (as in ``"sums"``' light capture, GradNorm
            without a per-sample instrument; ``"sums"`` beside one leaves it out, docs/design.md
            "Units"). Not with a GradientAccumulateOptimizer (it replaces
            ``p.grad`` each micro-step) nor under torch.distributed (DDP averages ``p.grad``
            over ranks; ``"sums"`` already reads DDP's ``p.grad`` where exact).
    """

    key = "grad_norm"
    needs = frozenset({"grad_sum"})
    per_group = True

    def __init__(self, source: str = "sums"):
        if source not in ("sums", "p.grad"):
            raise ValueError(
                f"GradNorm(source=...) must be 'sums' or 'p.grad', got {source!r}; e.g. "
                "GradNorm(source='p.grad') to read the window gradient from p.grad"
            )
        self.source = source
        #: why nothing can be measured on this Lens (a sharded model), set by the Lens
        self.unmeasurable: str | None = None
        self._params: Callable[[], Mapping[str, Tensor]] | None = None
        self._group_of: dict[str, str] = {}
        if source == "p.grad":  # no window sum: the Lens calls the grads_* methods below
            self.needs = frozenset()
            self.reads_optimizer_grads = True

    def __repr__(self) -> str:
        return "GradNorm()" if self.source == "sums" else f"GradNorm(source={self.source!r})"

    def finalize(self, stats: WindowStats, state):
        if self.source == "sums":
            return math.sqrt(float(stats.window_grad_sq_norm()))
        return self._from_grads(stats, state, "")

    def finalize_group(self, stats: WindowStats, state, names):
        if self.source == "sums":
            return self.finalize(stats, state)
        return self._from_grads(stats, state, self._group_of.get(names[0], "") if names else "")

    # ---- source="p.grad" -----------------------------------------------------------------
    def attach(self, params, optimizer) -> None:
        self._params = params
        if self.source != "p.grad":
            return
        if isinstance(optimizer, GradientAccumulateOptimizer):
            raise ValueError(
                "GradNorm(source='p.grad') reads the window gradient from p.grad, which a "
                "GradientAccumulateOptimizer replaces at every micro-step; use GradNorm()"
            )
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError(
                "GradNorm(source='p.grad') reads this process's p.grad, which DistributedDataParallel "
                "averages over ranks; use GradNorm() (under DDP it reads the global gradient from "
                "p.grad itself where that is exact)"
            )

    def bind_groups(self, group_of: dict[str, str]) -> None:
        self._group_of = dict(group_of)

    def start_window(self):
        if self.source == "sums":
            return None
        # plain data (a Lens checkpoint writes it): why the window is not measured, p.grad's
        # (id, version) after the last captured backward, ||p.grad||^2 per group ("" = all)
        # then, the squared norm p.grad had at the first captured backward's start, the
        # per-sample scales' range
        return {"why": None, "versions": None, "sq": None, "base": None, "cmin": None, "cmax": None}

    def group_state(self, state, names):
        return state

    def grads_before_backward(self, state, micro) -> None:
        """A captured backward starts: p.grad must be None or zero (the window's first) or as
        the previous captured backward left it."""
        if state["why"] is not None or self.unmeasurable:
            return
        params = self._params()
        if state["versions"] is None:  # the window's first: p.grad None, or zero (checked at the end)
            state["base"] = sum_sq([p.grad for p in params.values()])
        elif state["versions"] != _versions(params):
            state["why"] = (
                "not measured: p.grad changed between two captured backwards of the window (a "
                "backward outside lens.capture(), clipping or zeroing per micro-step); "
                "GradNorm() keeps its own sum"
            )

    def grads_after_backward(self, state, micro, scaler) -> None:
        """A captured micro-step folded: p.grad's (id, version), its squared norm per group, and
        the micro-step's per-sample scale c."""
        if state["why"] is not None or self.unmeasurable:
            return
        params = self._params()
        state["versions"] = _versions(params)
        grads: dict[str, list] = {}  # group ("" without groups) -> its p.grad
        for q, p in params.items():
            g = p.grad
            if g is None:
                continue
            if g.is_sparse or g.dtype not in (torch.float32, torch.float64):
                state["why"] = (
                    f"not measured: p.grad of {q} is {'sparse' if g.is_sparse else g.dtype}, not a dense "
                    "float32/float64 sum; GradNorm() accumulates in float32"
                )
                return
            grads.setdefault(self._group_of.get(q, ""), []).append(g)
        zero = torch.zeros((), dtype=torch.float64)
        sq = {k: _or(sum_sq(v), zero) for k, v in grads.items()}  # each p.grad read once
        sq[""] = sum(sq.values(), zero) if self._group_of else sq.get("", zero)
        state["sq"] = sq
        c = micro.scale()
        c = (c.detach().double().reshape(()) if isinstance(c, Tensor)
             else torch.tensor(float(c), dtype=torch.float64))
        state["cmin"] = c if state["cmin"] is None else torch.minimum(state["cmin"], c.to(state["cmin"].device))
        state["cmax"] = c if state["cmax"] is None else torch.maximum(state["cmax"], c.to(state["cmax"].device))

    def grads_written(self, state) -> None:
        return None

    def grads_before_update(self, state, stats: WindowStats, scaler) -> None:
        return None

    def grads_abort(self) -> None:
        return None

    def _why(self, state) -> str | None:
        if self.unmeasurable:
            return self.unmeasurable
        if state is None or state["why"] is not None:
            return None if state is None else state["why"]
        if state["sq"] is None:
            return "not measured: no captured backward of the window reached p.grad"
        if state["base"] is not None and float(state["base"]) != 0.0:
            return ("not measured: p.grad held a gradient when the window's first captured backward "
                    "started (call optimizer.zero_grad() before it, or use GradNorm())")
        lo, hi = float(state["cmin"]), float(state["cmax"])
        if lo != hi:
            return (f"not measured: the window's micro-steps have different per-sample scales ({lo:g} to "
                    f"{hi:g}: unequal micro-batches under a mean loss, or another loss multiplier), so "
                    "p.grad is not a multiple of sum_n g_n; GradNorm() keeps its own sum")
        return None

    def _from_grads(self, stats: WindowStats, state, group: str):
        if self._why(state) is not None:
            return None
        c = float(state["cmin"])
        sq = float(state["sq"].get(group, 0.0)) * c * c  # ||sum_n g_n||^2
        if stats.reduction == "mean":
            sq /= max(stats.num_samples, 1) ** 2
        return math.sqrt(sq)

    def meta(self, state) -> dict:
        if self.source == "sums":
            return {}
        why = self._why(state)
        return {} if why is None else {"grad_norm": why}


def _versions(params: Mapping[str, Tensor]) -> list:
    """(id, version) of every tracked parameter's p.grad (None where it has none)."""
    return [None if p.grad is None else (id(p.grad), tensor_version(p.grad)) for p in params.values()]


def _or(value, default):
    return default if value is None else value
