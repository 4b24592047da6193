"""The accumulation check: what the optimizer really got, against the window's exact gradient.

``record["accumulation_check"]["rel_error"]`` is ||g_opt - g|| / ||g|| at the window's update:

- **g**, the window's exact gradient: what the same loss gives on the whole window as one batch
  (docs/design.md "Units"). Under a mean objective the mean of the per-sample gradients,
  (1/N) sum_n g_n (the ``g`` of ``GradNorm``; for a framework that declares its window objective,
  as the Hugging Face Trainer does through ``capture(multiplier=B_k / N)``, that objective's
  gradient); under a sum objective sum_n g_n; for a **token-mean loss** (a mean
  ``cross_entropy`` / ``nll_loss`` over more targets than samples, e.g. ``logits.view(-1, V)``,
  each micro-step a mean over its own T_k counted targets) the mean over the window's
  T = sum_k T_k counted targets, (1/T) sum_k T_k grad L_k.
- **g_opt**, what the micro-steps' backwards left in ``p.grad`` for the optimizer, unscaled by a
  GradScaler's scale and before any clipping. It is read where it can be told apart from both:
  the squared norm of ``p.grad`` is taken after every captured backward (or, under a
  :class:`~gradlens.GradientAccumulateOptimizer`, when it has written its window gradient), and
  ``p.grad`` itself right before the update. Between the two only factors that multiply every
  gradient by one number may act (``clip_grad_norm_``, a GradScaler's unscale): their product f
  is the ratio of the two norms (exactly 1 when nothing changed ``p.grad``), and
  g_opt = p.grad / (f s) with s the GradScaler's scale (the scaler the Lens knows, its
  ``grad_scaler=``; the scale a GradScaler hands an amp-aware optimizer; or, for a scaler the
  Lens was not told of, f when it is an exact power of two: the unscale of a power-of-two scale
  is exact). The clip factor is f s (f for an optimizer that unscales itself). Any other change
  of ``p.grad`` after the last backward (``clip_grad_value_``, per-parameter clipping) counts as
  part of what the optimizer got, up to that one factor.

Cost: one dot product per tracked parameter after each captured backward (||p.grad||^2; none
under a GradientAccumulateOptimizer), and at the update, per tracked parameter, one transient
``g_opt - g`` and three dot products (0-d tensors: no host read before the record is made). No
per-sample gradient. A token-mean loss also keeps, during the window, one buffer per tracked
parameter (sum_k T_k grad L_k, float32 or wider: the token-weighted sum that neither the
window's sum_n g_n nor ``p.grad`` holds), filled by a hook on each tracked parameter during
tracked backwards (unavoidable where T_k / B_k varies; sent across ranks with the window).

Above ``tolerance`` the record names the cause where the window tells it (unequal micro-batches
under ``loss / K``, unequal token counts under a per-micro-step token mean, a
GradientAccumulateOptimizer without ``num_samples``, a factor applied twice or not at all) and a
fix that works in that loop, and a ``RuntimeWarning`` says so once per run.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

from gradlens import compat
from gradlens.core.sq_norms import sum_sq
from gradlens.core.stats import DistParts, WindowStats
from gradlens.instruments.base import Instrument
from gradlens.instruments.accumulation_causes import cause_and_fix
from gradlens.training.accum_optimizer import GradientAccumulateOptimizer

__all__ = ["AccumulationCheck", "CheckState"]

_F64 = torch.float64


@dataclass
class CheckState:
    """The window state of :class:`AccumulationCheck` (window-level only: no micro-step states).

    Attributes:
        ref_sq: ||p.grad||^2 over the tracked parameters at the reading (0-d float64), None
            before one; ``versions``: ``[name, id, version]`` of each ``p.grad`` then;
            ``where``: ``"backward"`` (after the last captured backward) or ``"wrapper"`` (a
            GradientAccumulateOptimizer's window gradient, unscaled); ``scale``: the scale of
            the GradScaler the Lens knows, at the reading (0-d), else None.
        sizes, mults: this rank's B_k and c_k (0-d float64: what multiplied micro-step k's
            objective on its way to backward) of each captured micro-step, for the cause.
        tokens: this rank's T_k (0-d) of the token-mean micro-steps; ``steps``: ``[token-mean
            micro-steps, micro-steps]`` (all ranks after the merge); ``token_count``: sum T_k and
            ``token_sum``: name -> sum_k T_k grad L_k (all ranks after the merge).
        wrapper_weighted: the GradientAccumulateOptimizer's window had ``num_samples``.
        measured: name -> ``[3]`` float64 (||g_opt - g||^2, ||g||^2, ||g_opt||^2), set at the update;
            ``factors``: ``[5]`` float64 (f, s, clip factor, 1 if s was inferred, 1 if the scale
            was known: a wrapper's gradient, the Lens's scaler, an amp-aware optimizer's).
        reference: ``"samples"``, ``"tokens"`` or ``"sum"``; ``note``: why nothing was measured.
    """

    ref_sq: Tensor | None = None
    versions: list | None = None
    where: str = ""
    scale: Tensor | None = None
    sizes: list = field(default_factory=list)
    mults: list = field(default_factory=list)
    tokens: list = field(default_factory=list)
    steps: list = field(default_factory=lambda: [0, 0])
    token_count: Tensor | None = None
    token_sum: dict | None = None
    wrapper_weighted: bool = False
    measured: dict | None = None
    factors: Tensor | None = None
    reference: str = ""
    note: str = ""


def _versions(params: Mapping[str, Tensor]) -> list:
    return [[q, id(p.grad), compat.tensor_version(p.grad)] for q, p in params.items() if p.grad is not None]


def _same_grads(params: Mapping[str, Tensor], versions: list | None) -> bool:
    """Whether the tracked parameters hold the same ``p.grad`` tensors as at the reading
    ``versions`` (changed in place or not: clipping and unscaling are measured by the norms)."""
    return versions is not None and [v[:2] for v in _versions(params)] == [v[:2] for v in versions]


def _dense(g: Tensor) -> Tensor:
    g = g.detach()
    return g.to_dense() if g.is_sparse else g


def _wide(t: Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


class AccumulationCheck(Instrument):
    """``record["accumulation_check"]``: dict, how far the gradient the optimizer stepped with
    is from the window's exact gradient (module docstring for the definitions and the cost):

    - ``"rel_error"``: ||g_opt - g|| / ||g|| (None when not measured: ``record.meta`` says why);
    - ``"grad_norm_optimizer"``: ||g_opt||, ``"grad_norm_window"``: ||g||;
    - ``"ratio"``: <g_opt, g> / ||g||^2 (1 when the optimizer got the window gradient; a pure
      factor applied twice shows here);
    - ``"clip_factor"``: what clipping multiplied the gradient by (1: none), ``"grad_scale"``:
      the GradScaler scale divided out (1: none);
    - ``"reference"``: which g: ``"samples"`` (mean over the window's N samples, or the window
      objective a framework declares), ``"tokens"`` (mean over its counted targets), ``"sum"``;
    - ``"cause"``: above ``tolerance``, what made the difference and the fix, else None.

    Per group (``Lens(groups=...)``): ``record.groups[g]["accumulation_check"]`` holds
    ``rel_error``, the two norms and ``ratio`` over the group's parameters (clipping and the
    scale are the whole gradient's).

    The check runs in light capture (parameter hooks, like ``GradNorm``), under the Lightning,
    Hugging Face and Accelerate callbacks (the optimizer's step hooks), and under DDP (the
    merged window against the all-reduced ``p.grad``; ``merge="sync"``). Under FSDP2 the
    optimizer's gradient lives in shards the Lens does not read: the record's meta says so.
    Without an optimizer (``lens.flush()``) the check reads ``p.grad`` at the flush if nothing
    changed it since the last captured backward.

    Args:
        tolerance: the ``rel_error`` above which the cause is named and a ``RuntimeWarning``
            (once per run) says so. Default 1e-4: float32 round-off of a window stays below.
    """

    key = "accumulation_check"
    needs = frozenset({"grad_sum"})
    per_group = True
    reads_optimizer_grads = True

    def __init__(self, tolerance: float = 1e-4) -> None:
        if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not (
                0 < tolerance < float("inf")):
            raise ValueError(
                f"AccumulationCheck(tolerance=...) must be a positive number (a relative error), got "
                f"{tolerance!r}; e.g. AccumulationCheck(tolerance=1e-4)"
            )
        self.tolerance = float(tolerance)
        self._params: Callable[[], Mapping[str, Tensor]] | None = None
        self._optimizer: Any = None
        self._hooks: list = []
        self._hooked: Any = None  # the micro-step whose backward the token hooks watch
        self._warned = False
        #: why nothing can be measured on this Lens (FSDP2), set by the Lens
        self.unmeasurable: str | None = None

    def __repr__(self) -> str:
        return f"AccumulationCheck(tolerance={self.tolerance:g})"

    def attach(self, params, optimizer) -> None:
        self._params, self._optimizer = params, optimizer

    def _tracked(self) -> Mapping[str, Tensor]:
        if self._params is None:
            raise RuntimeError(
                "AccumulationCheck reads the tracked parameters, which a Lens hands it when built; "
                "use it inside one: Lens(model, [AccumulationCheck()], optimizer=opt)"
            )
        return self._params()

    def start_window(self) -> CheckState:
        return CheckState()

    # ---- the Lens's calls (reads_optimizer_grads) ---------------------------------------------
    def grads_before_backward(self, state: CheckState, micro: Any) -> None:
        """A capture starts: for a token-mean loss, hook the tracked parameters so that this
        backward adds T_k / c_k times its dL/dp (= sum of the micro-step's token gradients) into
        ``state.token_sum``."""
        self.grads_abort()
        self._hooked = None
        calls = micro.loss_calls
        if len(calls) != 1 or calls[0].counted is None or micro.factor is not None:
            return
        counted = calls[0].counted
        coef: list[Tensor] = []

        def hook_for(q: str):
            def hook(g: Tensor) -> None:
                if not coef:  # the loss's multiplier is known by now (its hook fired first)
                    c = micro.multiplier
                    c = torch.as_tensor(1.0 if c is None else c, dtype=_F64, device=g.device)
                    coef.append(counted.to(device=g.device, dtype=_F64) / c.to(g.device))
                with torch.no_grad():
                    g = _dense(g)
                    add = g.to(_wide(g)) * coef[0].to(_wide(g))
                    acc = state.token_sum.get(q)
                    state.token_sum[q] = add if acc is None else acc.add_(add)
            return hook

        if state.token_sum is None:
            state.token_sum = {}
        self._hooks = [p.register_hook(hook_for(q)) for q, p in self._tracked().items() if p.requires_grad]
        self._hooked = (micro, counted)

    def grads_abort(self) -> None:
        """A capture ends (normally or not): remove the token hooks of its backward (idempotent)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def grads_after_backward(self, state: CheckState, micro: Any, scaler: Any) -> None:
        """A captured micro-step has folded into the window: its units, and (but under a
        GradientAccumulateOptimizer, which replaces ``p.grad``) ||p.grad||^2 as the backwards
        left it."""
        hooked, self._hooked = self._hooked, None
        self.grads_abort()
        c = micro.multiplier
        state.sizes.append(int(micro.batch_size))
        state.mults.append(torch.as_tensor(1.0 if c is None else c, dtype=_F64).detach().reshape(()))
        state.steps[1] += 1
        if hooked is not None and hooked[0] is micro:
            counted = hooked[1]
            state.tokens.append(counted)
            state.steps[0] += 1
            state.token_count = counted.to(_F64) if state.token_count is None else state.token_count + counted
        if isinstance(self._optimizer, GradientAccumulateOptimizer):
            return
        self._read(state, "backward")
        known = compat.grad_scaler_scale(scaler) if scaler is not None else None
        state.scale = None if known is None else known.detach().clone().reshape(()).to(_F64)

    def grads_written(self, state: CheckState) -> None:
        """A GradientAccumulateOptimizer wrote its window gradient into ``p.grad`` (unscaled,
        before its clip)."""
        self._read(state, "wrapper")
        if isinstance(self._optimizer, GradientAccumulateOptimizer):  # (the one that calls this)
            state.wrapper_weighted = bool(self._optimizer.accum_state.weighted)

    def _read(self, state: CheckState, where: str) -> None:
        params = self._tracked()
        state.ref_sq = sum_sq([p.grad for p in params.values()])
        state.versions = _versions(params)
        state.where = where

    def grads_before_update(self, state: CheckState, stats: WindowStats, scaler: Any) -> None:
        """Right before the update, the window merged: measure (no host read)."""
        self._measure(state, stats, scaler is not None or state.scale is not None)

    # ---- the measurement ---------------------------------------------------------------------
    def _measure(self, state: CheckState, stats: WindowStats, known_scaler: bool) -> None:
        if self.unmeasurable:
            state.note = self.unmeasurable
            return
        if state.ref_sq is None:
            state.note = ("not measured: no captured backward left a gradient in the tracked parameters' "
                          "p.grad before the update")
            return
        params = self._tracked()
        grads = {q: _dense(p.grad) for q, p in params.items() if p.grad is not None}
        if not grads:
            state.note = "not measured: no tracked parameter holds a gradient (p.grad) at the update"
            return
        ref_sq = state.ref_sq
        one = torch.ones((), dtype=_F64, device=ref_sq.device)
        # (a GradScaler's unscale does not count as a new version of p.grad: the norms tell)
        f = torch.sqrt(sum_sq(list(grads.values())).to(ref_sq.device) / ref_sq)
        inferred = torch.zeros((), dtype=_F64, device=ref_sq.device)
        told = state.where == "wrapper" or state.scale is not None or known_scaler
        amp = compat.optimizer_grad_scale(self._optimizer) if self._optimizer is not None else None
        if state.where == "wrapper":
            s = one
        elif state.scale is not None:
            s = state.scale.to(ref_sq.device)
        elif amp is not None:
            s, told = amp.detach().to(device=ref_sq.device, dtype=_F64).reshape(()), True
        elif known_scaler:
            s = one
        else:  # a GradScaler the Lens was not told of: its unscale is an exact power of two
            r = torch.round(torch.log2(f))
            pow2 = (r < 0) & ((f * torch.exp2(-r) - 1).abs() <= 1e-6)
            s = torch.where(pow2, torch.exp2(-r), one)
            inferred = pow2.to(_F64)
        clip = f if amp is not None else f * s
        alpha = 1.0 / (f * s)
        state.factors = torch.stack([f, s, clip, inferred, torch.full_like(f, float(told))])
        state.reference, ref_of = self._reference(state, stats)
        measured = {}
        with torch.no_grad():
            for q in params:
                g, r = grads.get(q), ref_of(q)
                if g is None and r is None:
                    continue
                if g is None:
                    g = torch.zeros_like(r)
                wide = _wide(g) if r is None else torch.promote_types(_wide(g), r.dtype)
                a = alpha.to(device=g.device, dtype=wide)
                d = g.to(wide) * a
                opt_sq = torch.dot(d.reshape(-1), d.reshape(-1))
                if r is not None:
                    r = r.to(device=g.device, dtype=wide)
                    d.sub_(r)
                    r_sq = torch.dot(r.reshape(-1), r.reshape(-1))
                else:
                    r_sq = torch.zeros((), dtype=wide, device=g.device)
                d_sq = torch.dot(d.reshape(-1), d.reshape(-1))
                measured[q] = torch.stack([d_sq, r_sq, opt_sq]).to(_F64)
        state.measured = measured

    def _reference(self, state: CheckState, stats: WindowStats):
        """``(name, q -> g's entry [*param] or None)``: the token mean where every micro-step of
        every rank was token-mean, else the sample mean (or the sum)."""
        tokens, steps = state.steps
        if tokens and tokens == steps and state.token_sum is not None and state.token_count is not None:
            inv = 1.0 / state.token_count
            acc = state.token_sum
            return "tokens", lambda q: None if q not in acc else acc[q] * inv.to(acc[q].device, acc[q].dtype)
        if tokens:
            state.note = (f"{tokens} of the window's {steps} micro-steps had a token-mean loss and the "
                          "others not: compared with the mean over the window's samples")
        acc = stats.grad_sum
        if stats.reduction == "sum":
            return "sum", lambda q: acc.get(q)
        n = max(stats.num_samples, 1)
        return "samples", lambda q: None if q not in acc else acc[q] / n

    # ---- the record --------------------------------------------------------------------------
    def finalize(self, stats: WindowStats, state: CheckState) -> dict[str, Any]:
        if state.measured is None and not state.note:
            self._at_flush(state, stats)
        if state.measured is None:
            return {"rel_error": None, "cause": None}
        rows = torch.stack(list(state.measured.values())).sum(0).cpu() if state.measured else torch.zeros(3, dtype=_F64)
        f, s, clip, inferred, told = state.factors.cpu().tolist()
        if not (0 < f < float("inf")):
            state.note = (f"not measured: the tracked parameters' p.grad at the update is {f:g} x what the "
                          "last captured backward left (zeroed, or not finite)")
            return {"rel_error": None, "cause": None}
        if inferred:
            state.note = (f"the GradScaler scale {s:g} was inferred (p.grad was divided by it after the last "
                          "backward: an exact power of two); pass Lens(..., grad_scaler=scaler) to state it")
        out = _summary(rows)
        out.update(clip_factor=clip, grad_scale=s, reference=state.reference, cause=None)
        rel = out["rel_error"]
        if rel is not None and not rel <= self.tolerance:  # nan too
            cause, fix = cause_and_fix(state, out, self._optimizer, self.tolerance, told=bool(told))
            out["cause"] = f"{cause}; fix: {fix}"
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"AccumulationCheck: the optimizer stepped with a gradient {rel:.3g} away (relative) "
                    f"from the window's exact gradient ({state.reference} mean of "
                    f"{stats.num_samples} samples): {cause}. Fix: {fix}. (Said once per run; "
                    "record['accumulation_check'] has every window's value.)",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return out

    def _at_flush(self, state: CheckState, stats: WindowStats) -> None:
        """No update hook saw the window (``lens.flush()``): measure now if ``p.grad`` is as the
        last captured backward left it."""
        if state.ref_sq is not None and state.where == "backward" and _same_grads(self._tracked(), state.versions):
            self._measure(state, stats, state.scale is not None)
            return
        state.note = state.note or self.unmeasurable or (
            "not measured: no optimizer step hook saw this window's update and p.grad changed after its "
            "last captured backward (or holds none); give the Lens the optimizer (Lens(..., optimizer=opt))"
        )

    def finalize_group(self, stats: WindowStats, state: CheckState, names: tuple[str, ...]) -> dict[str, Any]:
        if state.measured is None:
            return {"rel_error": None}
        rows = [state.measured[q] for q in names if q in state.measured]
        return _summary(torch.stack(rows).sum(0).cpu() if rows else torch.zeros(3, dtype=_F64))

    def meta(self, state: CheckState) -> dict[str, Any]:
        return {self.key: state.note} if state.note else {}

    # ---- across ranks: the token-weighted sums (the rest is measured after the merge) ----------
    def to_buffers(self, state: CheckState, ctx: Any) -> DistParts:
        count = state.token_count if state.token_count is not None else torch.zeros((), dtype=_F64)
        sums = [torch.tensor(state.steps, dtype=_F64), count.to(_F64).reshape(())]
        if state.steps[0]:  # every rank has token-mean micro-steps (the same loss code)
            acc = state.token_sum or {}
            for q, p in ctx.params.items():
                sums.append(acc[q] if q in acc else torch.zeros(p.shape, dtype=_wide(p), device=p.device))
        return DistParts(sums=sums)

    def from_buffers(self, state: CheckState, ctx: Any, sums, per_rank, pieces) -> CheckState:
        state.steps = [int(round(float(v))) for v in sums[0].tolist()]
        if state.steps[0]:
            state.token_count = sums[1]
            state.token_sum = {q: v for q, v in zip(ctx.params, sums[2:])}
        return state


def _summary(rows: Tensor) -> dict[str, Any]:
    """rel_error, the two norms and the ratio from ``[3]`` (||g_opt - g||^2, ||g||^2, ||g_opt||^2)."""
    d_sq, r_sq, o_sq = (float(v) for v in rows)
    rel = math.sqrt(d_sq / r_sq) if r_sq > 0 else (0.0 if d_sq == 0 else float("inf"))
    ratio = (o_sq + r_sq - d_sq) / (2 * r_sq) if r_sq > 0 else float("nan")
    return {"rel_error": rel, "grad_norm_optimizer": math.sqrt(o_sq), "grad_norm_window": math.sqrt(r_sq),
            "ratio": ratio}
