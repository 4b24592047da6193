"""Alpha: the local effective step length along the optimizer's real update, and the
search-direction projections (:func:`alpha_fit`: the noise-informed quadratic fit)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from gradlens.core.stats import WindowStats
from gradlens.instruments.crosssample import _CrossSample, _DotState, _nbytes
from gradlens.core.state_checks import COUNT, TENSORS, StateDictError, check_state, label, optional

__all__ = ["Alpha", "alpha_fit"]

#: variance used in the Alpha fit where an observed variance is exactly 0 (as in Cockpit)
_VAR_FLOOR = 1e-10


def alpha_fit(
    step_len: float, fs: tuple[float, float], dfs: tuple[float, float],
    var_fs: tuple[float, float], var_dfs: tuple[float, float],
) -> tuple[float | None, str]:
    """The noise-informed quadratic fit of Mahsereci & Hennig (2017) / Cockpit along the update.

    The line is parametrised by the distance ``s`` along d / ||d||, start at 0, end at
    ``step_len = ||d||``. Observations ``f(0), f(step_len), f'(0), f'(step_len)`` (mean losses
    and mean directional derivatives ``mean_n(d . g_n) / ||d||``) with variances ``var_*`` (zeros
    replaced by 1e-10, as in Cockpit) give the weighted least-squares quadratic
    ``q(s) = mu0 + mu1 s + mu2 s^2``; with ``s_min = -mu1 / (2 mu2)``,

        alpha = step_len / s_min - 1   (= 2 step_len / (-mu1 / mu2) - 1),

    so 0 means the step landed at the fit's minimum, -1 that it stayed at the start, 1 that it
    went twice as far. A fit without a minimum (``mu2 <= 0``) gives -1 (as in Cockpit).

    Returns:
        ``(alpha, note)``; ``alpha`` is None if the fit is singular.
    """
    t = float(step_len)
    phi = torch.tensor(
        [[1.0, 0.0, 0.0], [1.0, t, t * t], [0.0, 1.0, 0.0], [0.0, 1.0, 2.0 * t]], dtype=torch.float64
    )
    y = torch.tensor([fs[0], fs[1], dfs[0], dfs[1]], dtype=torch.float64)
    var = torch.tensor([*var_fs, *var_dfs], dtype=torch.float64)
    var = torch.where(var == 0, torch.full_like(var, _VAR_FLOOR), var)
    # weighted least squares as an ordinary one, sqrt(w) phi mu ~ sqrt(w) y, solved by
    # Householder QR: the normal equations would square the condition number of phi
    # (columns scaled to unit norm first, so that a short step's t^2 column is not lost)
    root_w = var.rsqrt()
    a = root_w[:, None] * phi
    norms = a.norm(dim=0)
    if not bool((norms > 0).all()):
        return None, "singular quadratic fit"
    q, r = torch.linalg.qr(a / norms)  # q [4, 3], r [3, 3] upper triangular
    diag = r.diagonal().abs()
    if not bool((diag > 4 * torch.finfo(torch.float64).eps * diag.max()).all()):
        return None, "singular quadratic fit"
    mu = torch.linalg.solve_triangular(r, (q.T @ (root_w * y))[:, None], upper=True)[:, 0] / norms
    mu1, mu2 = float(mu[1]), float(mu[2])
    if mu2 <= 0:
        return -1.0, "the fit has no minimum along d (concave or linear): alpha = -1 as in Cockpit"
    if mu1 == 0:
        return math.inf, "the fit's minimum is at the start point"
    return 2.0 * t * mu2 / (-mu1) - 1.0, ""


class Alpha(_CrossSample):
    """``record["alpha"]``: the local effective step length of Mahsereci & Hennig (2017) as in
    Cockpit (Schneider et al. 2021), for the update the optimizer actually made,
    d = theta_{t+1} - theta_t over the tracked parameters (any optimizer, momentum, Adam,
    clipping, accumulation), and ``record["search_dir_projections"]``.

    Start point: this window's samples at theta_t; end point: the *next* window's samples at
    theta_{t+1}. Observations (see :func:`alpha_fit`):

    * ``f(0)``, ``f(1)``: mean of the per-sample losses (``lens.capture(losses=...)``, ``[B_k]``
      per micro-step) of each window, with variance ``Var_n(loss_n) / N`` (unbiased);
    * ``f'(0)``, ``f'(1)``: mean over samples of ``d . g_n / ||d||`` of each window, with variance
      ``Var_n(d . g_n / ||d||) / N``.

    (Cockpit uses ``Var_n`` without ``/ N``; the fit is invariant to a common factor, so the two
    agree whenever both windows have the same N.) Under a "sum" loss the fit uses the same
    per-sample means: alpha is a property of the line, not of the loss scale.

    ``record["search_dir_projections"]``: dict ``{"start": [N_t] d . g_n / ||d||^2 (this window),
    "end": [N_{t+1}] d . g'_n / ||d||^2 (next window, at theta_{t+1}), "update_sq_norm": ||d||^2}``
    (float64).

    **When the record appears.** Alpha of window t needs window t+1, so the Lens keeps record t
    *pending*: it is in ``lens.records`` at once with ``record["alpha"] = None`` and
    ``record.meta["alpha"] = "pending: ..."``; when window t+1 closes, the values are filled in
    and the record is written to the sinks (JSONL, TensorBoard). If window t+1 is not tracked
    (``every``; Alpha needs two consecutive tracked windows, e.g.
    ``every=lambda s: s % 10 in (0, 1)``), captures nothing, or the Lens is closed first,
    ``record["alpha"]`` stays None and ``record.meta["alpha"]`` says why; likewise if no update
    closed window t (``lens.flush()``, or an optimizer step skipped by a GradScaler), if the
    parameters did not change (d = 0), if per-sample losses were not given, or if N < 2.

    **Memory.** The end-point projections onto d (known by then) are computed during the next
    window's backward passes, exactly, from the layer factors, without storage. The start point
    needs this window's g_n after the update: exact mode keeps the layer factors (and theta_t,
    to form d) within ``max_bytes``; sketch mode keeps ``[N, k]`` sketches and estimates
    ``d . g_n`` by ``s(d) . s(g_n)`` (unbiased, standard deviation <= sqrt(8/k) ||d|| ||g_n||).
    ``record.meta["search_dir_projections"]`` says which.
    """

    key = "alpha"

    def __init__(self, mode: str = "exact", **kwargs):
        super().__init__(mode, **kwargs)
        self._direction: dict[str, Any] | None = None  # the last update, for the next window
        self._token = 0

    # ---- capture: end-point projections onto the previous update --------------------------
    def update_layer(self, state: _DotState, module, a: Tensor, delta: Tensor) -> None:
        super().update_layer(state, module, a, delta)
        direction = self._direction
        if direction is None:
            return
        part = state.part()
        D = {attr: direction["d"][q] for attr, q in module.params.items() if q in direction["d"]}
        if not D:
            return
        proj = module.kernel.directional(module.module, a, delta, D, module.params).double()
        part.end_proj = proj if part.end_proj is None else part.end_proj + proj
        part.end_token = direction["token"]

    def micro_done(self, state: _DotState, batch_size: int, reduction: str, losses) -> None:
        super().micro_done(state, batch_size, reduction, losses)
        if losses is not None:
            if not isinstance(losses, Tensor) or losses.numel() != batch_size:
                shape = tuple(losses.shape) if isinstance(losses, Tensor) else type(losses).__name__
                raise ValueError(
                    f"lens.capture(losses=...) must be the per-sample losses of this micro-step, "
                    f"a tensor of {batch_size} elements, got {shape}; compute them with "
                    "reduction='none' (e.g. F.cross_entropy(out, y, reduction='none'))"
                )
            state.part().losses = losses.detach().reshape(-1).double()  # on its device until the window closes

    def _extra_bytes(self, state: _DotState) -> int:
        return sum(_nbytes(p) for p in state.params.values())  # theta_t snapshot

    # ---- around the real update -----------------------------------------------------------
    #: theta_t and theta_{t+1} are read around the update (under FSDP2: the gathered values)
    reads_update_values = True

    def present_values(self, state: _DotState, values) -> None:
        if isinstance(state.params, dict):
            state.params = {q: values.get(q, v) for q, v in state.params.items()}

    def before_update(self, state: _DotState) -> None:
        state.theta0 = {q: p.detach().clone() for q, p in state.params.items()}

    def after_update(self, state: _DotState) -> None:
        if state.theta0 is None or not state.parts:
            return
        # theta_{t+1} - theta_t in the parameters' dtype (exact for nearby floats, Sterbenz)
        # formed in place in the snapshot's memory (no new D-sized allocation)
        d = {q: torch.sub(p.detach(), state.theta0[q], out=state.theta0[q]) for q, p in state.params.items()}
        state.theta0 = None
        sq = float(sum(torch.dot(v.flatten(), v.flatten()).double() for v in d.values()))
        self._token += 1
        start: dict[str, Any] = {"token": self._token, "sq_norm": sq}
        if sq > 0:
            if self.mode == "sketch":
                proj = self._sketches(state) @ self._sketch_direction(state, d)
            else:
                proj = self._project(state, d)
            start["proj"] = proj
            start["losses"] = (
                torch.cat([p.losses for p in state.parts])
                if all(p.losses is not None for p in state.parts)
                else None
            )
            self._direction = {"token": self._token, "d": d}
        else:
            self._direction = None
        for p in state.parts:  # factors are not needed any more
            p.layers = {}
            p.sketch = None
        state.start = start

    # ---- record ---------------------------------------------------------------------------
    def finalize(self, stats: WindowStats, state: _DotState) -> None:
        return None

    def defers(self, state: _DotState) -> bool:
        return state.start is not None and state.start["sq_norm"] > 0

    def meta(self, state: _DotState) -> dict[str, Any]:
        if state.start is None:
            return {
                "alpha": "missing: no optimizer update closed this window (lens.flush() without "
                "an optimizer step, e.g. after a step skipped by a GradScaler, or no optimizer "
                "given to the Lens)"
            }
        if state.start["sq_norm"] == 0:
            return {"alpha": "missing: the update was zero (parameters unchanged: skipped step?)"}
        return {"alpha": "pending: needs the next window (its gradients at theta_{t+1})"}

    def settle(self, record, state: _DotState, next_state: _DotState | None, reason) -> None:
        start = state.start
        token = start["token"]
        if self._direction is not None and self._direction["token"] == token:
            self._direction = None  # consumed (or stale: the next window was not captured)
        sq = start["sq_norm"]
        proj_meta = f"start: {self.mode_name}, end: exact"
        proj = {"start": start["proj"] / sq, "update_sq_norm": sq}
        record.values["search_dir_projections"] = proj
        record.meta["search_dir_projections"] = proj_meta
        if next_state is None:
            record.meta["alpha"] = f"missing: {reason}"
            return
        if not next_state.parts or any(p.end_token != token for p in next_state.parts):
            record.meta["alpha"] = (
                "missing: the next window's gradients were not projected on this update"
            )
            return
        end = torch.cat([p.end_proj for p in next_state.parts])
        proj["end"] = end / sq
        losses_end = (
            torch.cat([p.losses for p in next_state.parts])
            if all(p.losses is not None for p in next_state.parts)
            else None
        )
        if start["losses"] is None or losses_end is None:
            record.meta["alpha"] = (
                "missing: per-sample losses were not given; pass "
                "lens.capture(losses=per_sample_losses) in this window and the next"
            )
            return
        n0, n1 = start["proj"].numel(), end.numel()
        if n0 < 2 or n1 < 2:
            record.meta["alpha"] = f"missing: variances need N >= 2 samples (got {n0} and {n1})"
            return
        norm = math.sqrt(sq)
        df0, df1 = start["proj"] / norm, end / norm
        value, note = alpha_fit(
            norm,
            (float(start["losses"].mean()), float(losses_end.mean())),
            (float(df0.mean()), float(df1.mean())),
            (float(start["losses"].var()) / n0, float(losses_end.var()) / n1),
            (float(df0.var()) / n0, float(df1.var()) / n1),
        )
        record.values["alpha"] = value
        record.meta["alpha"] = self.mode_name if value is not None else f"missing: {note}"
        if note and value is not None:
            record.meta["alpha_note"] = note

    # ---- checkpoints (gradlens.lens.state) ----------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The settings of :meth:`_CrossSample.state_dict` and what Alpha keeps between windows:
        ``token`` (the count of updates seen, which pairs a pending record with the next
        window's projections), ``direction`` (the last update d = theta_{t+1} - theta_t,
        parameter name -> ``[*param]``, or None) and ``direction_token`` (its token)."""
        d = self._direction
        return {
            **self._settings(),
            "token": self._token,
            "direction_token": None if d is None else d["token"],
            "direction": None if d is None else dict(d["d"]),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        checks = {"token": COUNT, "direction_token": optional(COUNT), "direction": optional(TENSORS)}
        check_state(self, state, checks, same=self._settings())
        if (state["direction"] is None) != (state["direction_token"] is None):
            raise StateDictError(
                f"the state of {label(self)} has direction_token={state['direction_token']!r} "
                "but " + ("no direction" if state["direction"] is None else "a direction") + "; "
                "the checkpoint is damaged: save it again"
            )
        self._token = state["token"]
        d = state["direction"]
        self._direction = None if d is None else {"token": state["direction_token"], "d": dict(d)}

    def parameter_tensors(self, state: dict[str, Any]) -> dict[str, dict[str, Tensor]]:
        d = state.get("direction") if isinstance(state, dict) else None
        return {"direction": d} if isinstance(d, dict) else {}
