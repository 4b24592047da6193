"""Curvature of the window objective: HessMaxEV, HessTrace, TICDiag, TICTrace, and cockpit's
three configurations with gradlens' names.

The Hessian is that of the **window objective** (docs/design.md), all K micro-steps of every
rank: ``(1/N) sum_n loss_n`` for a mean objective, ``sum_n loss_n`` for a sum. It is reached by
Hessian-vector products through the micro-steps' own backward graphs:

* on a tracked window the user's micro-steps backpropagate with ``create_graph=True``
  (``loss.backward(create_graph=lens.create_graph)``: True exactly on the tracked windows of a
  Lens with a curvature instrument);
* :class:`WindowGraph` hooks the tracked parameters and keeps, per micro-step k, its gradient
  ``dL_k/dtheta`` *with its graph*, times the micro-step's per-sample scale s_k (``B_k / c``
  under a mean loss, ``1 / c`` under a sum, c the known loss multiplier: 1/K, a GradScaler
  scale), summed over the window: ``W = sum_n g_n`` with its graph;
* at the window's end (before the optimizer's update, or in ``finalize`` after
  ``lens.flush()``) ``H v = d<W, v>/dtheta / N`` (mean) or ``d<W, v>/dtheta`` (sum), one
  ``autograd.grad`` per batch of vectors; under torch.distributed each product is all-reduced
  (sum) over the Lens' process group and normalised by the global N.

Memory: the K micro-steps' double-backward graphs stay alive until the window's end (about
2-3x the activations of one micro-step each), plus the vectors of the method (Lanczos basis
``[max_iter, D]``, probes ``[chunk, D]``). Time: one HVP costs about two backward passes of the
whole window; the instruments run only on tracked windows (``Lens(..., every=k)``), untracked
windows backpropagate without a graph and pay nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from gradlens.instruments.alpha import Alpha
from gradlens.instruments.base import Instrument
from gradlens.core.side import in_side_backward
from gradlens.core.stats import DistParts, WindowStats
from gradlens.instruments.hist import GradHist1d
from gradlens.instruments.hist2d import GradHist2d
from gradlens.instruments.mean_tests import InnerTest, OrthoTest
from gradlens.instruments.norms import GradNorm
from gradlens.instruments.tests import NormTest
from gradlens.instruments.trajectory import Distance, UpdateSize

__all__ = [
    "WindowGraph",
    "HessMaxEV",
    "HessTrace",
    "TICDiag",
    "TICTrace",
    "configuration",
    "TIC_EPS",
]

#: cockpit's epsilon in the TIC denominators
TIC_EPS = 1e-7


class WindowGraph:
    """The window's gradient sum ``W = sum_n g_n`` with its autograd graph, and Hessian-vector
    products of the window objective from it.

    The Lens creates one per tracked window (for all curvature instruments: their products
    share the graph and a cache), installs its parameter hooks, calls :meth:`end_micro` after
    each captured micro-step and :meth:`release` when the window is over.

    Args:
        params: qualified name -> tracked parameter (the Hessian's coordinates, in this order).
        group: the Lens' process group (None: this process alone).
        model: the watched model (for the exact diagonal by second-order backpropagation).
    """

    def __init__(self, params: dict[str, Tensor], group: Any = None, model: Any = None):
        self.params = dict(params)
        self.group = group
        self.model = model
        #: the second-order backpropagation of the diagonal, once an instrument asks for it
        self.backprop = None
        self.grad: dict[str, Tensor] = {}
        self.num_samples = 0  # this rank's N
        self.reduction: str | None = None
        self.cache: dict[Any, Any] = {}
        self.products = 0  # Hessian-vector products computed (vectors, not calls)
        self._micro: dict[str, Tensor] = {}
        self._handles: list = []
        self._norm: float | None = None
        self._batched = True
        self.busy = False  # products running: the Lens' own backward hooks stand aside
        self.dim = sum(p.numel() for p in self.params.values())

    # ---- capture ---------------------------------------------------------------------------
    def install(self) -> None:
        if not self._handles:
            self._handles = [
                p.register_hook(self._hook(q)) for q, p in self.params.items() if p.requires_grad
            ]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.backprop is not None:
            self.backprop.remove()

    def request_backprop_diagonal(self) -> None:
        """Record the micro-steps for the exact second-order backpropagation of the Hessian
        diagonal that :meth:`diagonal` then uses (:class:`~gradlens.instruments.diag_hessian.DiagHessianBackprop`;
        idempotent; nothing for a model it does not support)."""
        if self.backprop is None and self.model is not None and not self.grad:
            from gradlens.instruments.diag_hessian import DiagHessianBackprop

            self.backprop = DiagHessianBackprop(self.model, self.params)
            if self._handles:
                self.backprop.install()

    @property
    def backprop_ok(self) -> bool:
        """Whether the exact diagonal by second-order backpropagation covers this window."""
        return self.backprop is not None and self.backprop.supported

    def _hook(self, q: str):
        def hook(grad: Tensor) -> None:
            if in_side_backward():  # a per-sample gradient formed inside the capture, not the window's
                return
            prev = self._micro.get(q)
            self._micro[q] = grad if prev is None else prev + grad

        return hook

    def end_micro(self, scale: float | Tensor, batch_size: int, reduction: str) -> None:
        """Fold this micro-step's gradients (with their graphs) into ``W``: ``W += s_k dL_k``."""
        micro, self._micro = self._micro, {}
        if not micro:
            return
        if not any(g.requires_grad for g in micro.values()):
            raise RuntimeError(
                "a curvature instrument (HessMaxEV, HessTrace, TICDiag, TICTrace) needs the "
                "micro-step's gradient with its graph, but this tracked micro-step's backward ran "
                "without create_graph=True; call loss.backward(create_graph=lens.create_graph) "
                "(True on the tracked windows only)"
            )
        if isinstance(scale, Tensor):
            scale = scale.detach()
        for q, g in micro.items():
            term = g * scale
            self.grad[q] = term if q not in self.grad else self.grad[q] + term
        self.num_samples += int(batch_size)
        self.reduction = reduction
        if self.backprop is not None:
            self.busy = True
            try:
                self.backprop.end_micro(scale)
            finally:
                self.busy = False

    def release(self) -> None:
        """Drop the graph (the window is over)."""
        self.remove()
        self.grad = {}
        self._micro = {}
        self.cache = {}

    # ---- products --------------------------------------------------------------------------
    def _normaliser(self) -> float:
        """1/N_global for a mean objective, 1 for a sum (one all_reduce of N when distributed)."""
        if self._norm is None:
            n = self.num_samples
            if self.group is not None:
                import torch.distributed as dist

                t = torch.tensor([float(n)], dtype=torch.float64, device=self._device())
                dist.all_reduce(t, group=self.group)
                n = int(round(float(t)))
            self.global_samples = n
            self._norm = 1.0 / max(n, 1) if self.reduction == "mean" else 1.0
        return self._norm

    def _device(self) -> torch.device:
        return next(iter(self.params.values())).device

    def dtype(self) -> torch.dtype:
        p = next(iter(self.params.values()))
        return torch.promote_types(p.dtype, torch.float32)

    def hvp(self, V: Tensor) -> Tensor:
        """``[m, D] -> [m, D]``: the window objective's Hessian times each row of ``V`` (flat,
        parameters in :attr:`params` order), summed across ranks."""
        return self._reduce(self.local_hvp(V)) * self._normaliser()

    def _reduce(self, t: Tensor) -> Tensor:
        """Sum over the ranks of the Lens' group (in place; nothing without one)."""
        if self.group is not None:
            import torch.distributed as dist

            dist.all_reduce(t, group=self.group)
        return t

    def local_hvp(self, V: Tensor) -> Tensor:
        """``[m, D]``: ``d<W_r, v>/dtheta`` for this rank's W_r, not summed nor normalised
        (linear in the rank's samples: reduce only what is needed of it)."""
        if not self.grad:
            raise RuntimeError(
                "no tracked micro-step of this window reached the curvature instruments; run "
                "the window's backward inside lens.capture() with create_graph=lens.create_graph"
            )
        self._normaliser()  # every rank, before its first product
        self.remove()  # this window's micro-steps are over
        self.busy = True
        try:
            return self._hvp(V)
        finally:
            self.busy = False

    def _hvp(self, V: Tensor) -> Tensor:
        m = V.shape[0]
        names = [q for q in self.params if q in self.grad and self.grad[q].requires_grad]
        inputs = list(self.params.values())
        offsets, off = {}, 0
        for q, p in self.params.items():
            offsets[q] = (off, off + p.numel())
            off += p.numel()
        outs = [self.grad[q] for q in names]
        vs = [V[:, offsets[q][0] : offsets[q][1]].reshape(m, *self.params[q].shape).to(self.grad[q].dtype)
              for q in names]
        res = None
        if outs and m > 1 and self._batched:
            try:
                res = torch.autograd.grad(outs, inputs, grad_outputs=vs, retain_graph=True,
                                          allow_unused=True, is_grads_batched=True)
            except RuntimeError:  # an operation without a batching rule: one product at a time
                self._batched = False
        if outs and res is None:
            rows = [torch.autograd.grad(outs, inputs, grad_outputs=[v[i] for v in vs], retain_graph=True,
                                        allow_unused=True) for i in range(m)]
            res = [None if rows[0][j] is None else torch.stack([r[j] for r in rows]) for j in range(len(inputs))]
        out = V.new_zeros(m, self.dim, dtype=self.dtype())
        if outs:
            for (q, p), r in zip(self.params.items(), res):
                if r is not None:
                    out[:, offsets[q][0] : offsets[q][1]] = r.detach().reshape(m, -1)
        self.products += m
        return out

    def diagonal(self, chunk: int) -> Tensor:
        """``[D]`` float64: the exact Hessian diagonal: by second-order backpropagation where it
        covers the window (:attr:`backprop_ok`), else ``H_jj = e_j^T H e_j`` from ceil(D / chunk)
        batched products with one-hot vectors (cached per window)."""
        key = ("diagonal",)
        if key not in self.cache and self.backprop_ok:
            self._normaliser()
            parts = self.backprop.diag
            diag = torch.cat([
                parts[q].reshape(-1) if q in parts else torch.zeros(p.numel(), dtype=torch.float64, device=self._device())
                for q, p in self.params.items()
            ])
            self.cache[key] = self._reduce(diag) * self._normaliser()
        if key not in self.cache:
            D = self.dim
            diag = torch.empty(D, dtype=torch.float64, device=self._device())
            for lo in range(0, D, chunk):
                hi = min(D, lo + chunk)
                idx = torch.arange(lo, hi, device=self._device())
                V = torch.zeros(hi - lo, D, dtype=self.dtype(), device=self._device())
                V[torch.arange(hi - lo, device=V.device), idx] = 1.0
                diag[lo:hi] = self.local_hvp(V)[torch.arange(hi - lo, device=V.device), idx].double()
            self.cache[key] = self._reduce(diag) * self._normaliser()  # one collective of D numbers
        return self.cache[key]

    def hutchinson(self, probes: int, chunk: int, seed: int) -> tuple[Tensor, Tensor]:
        """Rademacher probes v_i (i < ``probes``, a private generator seeded with ``seed``):
        ``([probes] v_i^T H v_i, [D] mean_i v_i * H v_i)`` float64, both unbiased (for tr H and
        diag H); cached per (probes, seed)."""
        key = ("hutchinson", probes, seed)
        if key not in self.cache:
            gen = torch.Generator().manual_seed(seed)
            quad, diag = [], torch.zeros(self.dim, dtype=torch.float64, device=self._device())
            for lo in range(0, probes, chunk):
                m = min(chunk, probes - lo)
                V = (torch.randint(0, 2, (m, self.dim), generator=gen) * 2 - 1).to(self._device(), self.dtype())
                VHV = V * self.local_hvp(V)
                quad.append(VHV.double().sum(1))
                diag += VHV.double().sum(0)
            both = self._reduce(torch.cat([*quad, diag])) * self._normaliser()  # one collective
            self.cache[key] = (both[:probes], both[probes:] / probes)
        return self.cache[key]


@dataclass
class _CurvState:
    #: the window's graph, bound by the Lens (never saved: a Lens state refuses one that holds
    #: micro-steps, :mod:`gradlens.lens.state_codec`, and the loading Lens binds its own)
    graph: WindowGraph | None = None
    done: bool = False
    value: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)


class _Curvature(Instrument):
    """Shared life of the curvature instruments: the Lens binds the window's
    :class:`WindowGraph` to the state; the value is computed once, before the optimizer's update
    (or in ``finalize`` when the window is closed by ``lens.flush()``), and the graph let go."""

    needs = frozenset({"graph_grad"})

    def __init__(self, seed: int = 0):
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"{type(self).__name__}(seed=...) takes an int, got {seed!r}")
        self.seed = seed
        self._windows = 0  # windows computed: the private random stream's position

    def start_window(self) -> _CurvState:
        return _CurvState()

    def bind_graph(self, state: _CurvState, graph: WindowGraph) -> None:
        state.graph = graph

    def _window_seed(self) -> int:
        return (self.seed * 1_000_003 + self._windows) % (2**63)

    def _run(self, state: _CurvState) -> None:
        if not state.done and state.graph is not None and state.graph.grad:
            self.compute(state, state.graph)
            self._windows += 1
            state.done = True
        state.graph = None

    def before_update(self, state: _CurvState) -> None:
        self._run(state)  # the products need theta_t: the update changes parameters in place

    def finalize(self, stats: WindowStats, state: _CurvState) -> Any:
        self._run(state)  # a window closed by lens.flush(): the parameters did not move
        return state.value

    def extra(self, state: _CurvState) -> dict[str, Any]:
        return dict(state.extra)

    def meta(self, state: _CurvState) -> dict[str, Any]:
        return dict(state.meta)

    def compute(self, state: _CurvState, graph: WindowGraph) -> None:
        raise NotImplementedError

    def to_buffers(self, state, ctx):

        return DistParts()  # products are all-reduced by WindowGraph itself

    def from_buffers(self, state, ctx, sums, per_rank, pieces):
        return state


def _check_int(owner: str, name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{owner}({name}=...) must be an int >= {low}, got {value!r}")
    return value


class HessMaxEV(_Curvature):
    """``record["hess_max_ev"]``: float, the largest **algebraic** eigenvalue of the window
    objective's Hessian (not the one of largest magnitude), by Lanczos with full
    reorthogonalisation (float64 tridiagonal, ``torch.linalg.eigh``).

    Stops when the largest Ritz value's residual ``beta_k |s_k|`` (an eigenvalue of H lies that
    close to it) is at most ``tol * max_i |theta_i|`` (the Ritz values' spectral scale), or when
    the Krylov space is exhausted (exact). ``record.meta["hess_max_ev"]`` says
    ``"converged"`` or ``"not converged"``; ``meta["hess_max_ev_iterations"]`` and
    ``meta["hess_max_ev_residual"]`` (relative) go with it.

    Args:
        tol: relative tolerance (default 1e-3).
        max_iter: at most this many products (default 64); the basis holds ``[max_iter, D]``.
        seed: the private stream of start vectors (the global torch RNG is untouched).
    """

    key = "hess_max_ev"

    def __init__(self, tol: float = 1e-3, max_iter: int = 64, seed: int = 0):
        super().__init__(seed)
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 < tol < 1:
            raise ValueError(f"HessMaxEV(tol=...) must be a float in (0, 1), got {tol!r}; e.g. tol=1e-3")
        self.tol = float(tol)
        self.max_iter = _check_int("HessMaxEV", "max_iter", max_iter, 2)

    def __repr__(self) -> str:
        return f"HessMaxEV(tol={self.tol}, max_iter={self.max_iter})"

    def compute(self, state: _CurvState, graph: WindowGraph) -> None:
        D, dtype, device = graph.dim, graph.dtype(), graph._device()
        steps = min(self.max_iter, D)
        gen = torch.Generator().manual_seed(self._window_seed())
        Q = torch.zeros(steps, D, dtype=dtype, device=device)
        q = torch.randn(D, generator=gen, dtype=torch.float64).to(device, dtype)
        Q[0] = q / q.norm()
        alphas: list[float] = []
        betas: list[float] = []
        theta, rel, converged = float("nan"), float("inf"), False
        for k in range(steps):
            w = graph.hvp(Q[k : k + 1])[0]
            a = float(torch.dot(Q[k].double(), w.double()))
            alphas.append(a)
            basis = Q[: k + 1]
            for _ in range(2):  # full reorthogonalisation, twice is enough
                w = w - basis.t().mv(basis.mv(w))
            b = float(w.double().norm())
            T = torch.diag(torch.tensor(alphas, dtype=torch.float64))
            if betas:
                off = torch.tensor(betas, dtype=torch.float64)
                T = T + torch.diag(off, 1) + torch.diag(off, -1)
            evals, evecs = torch.linalg.eigh(T)
            theta = float(evals[-1])
            scale = float(evals.abs().max())
            rel = b * float(evecs[-1, -1].abs()) / scale if scale > 0 else 0.0
            exhausted = k + 1 == D or b <= 1e-12 * max(scale, 1e-300)
            if rel <= self.tol or exhausted:
                converged = True
                if exhausted:
                    rel = 0.0
                break
            if k + 1 < steps:
                betas.append(b)
                Q[k + 1] = w / b
        state.value = theta
        state.meta = {
            self.key: "converged" if converged else "not converged",
            f"{self.key}_iterations": len(alphas),
            f"{self.key}_residual": rel,
        }


class _DiagonalUser(_Curvature):
    """Instruments reading the Hessian diagonal or trace: exact (one-hot products) when the
    tracked parameters number at most ``exact_max_params``, else Hutchinson's estimate."""

    def __init__(self, exact_max_params: int = 4096, probes: int = 32, chunk: int = 64,
                 method: str = "auto", seed: int = 0):
        super().__init__(seed)
        name = type(self).__name__
        self.exact_max_params = _check_int(name, "exact_max_params", exact_max_params, 0)
        self.probes = _check_int(name, "probes", probes, 2)
        self.chunk = _check_int(name, "chunk", chunk, 1)
        if method not in ("auto", "exact", "hutchinson"):
            raise ValueError(
                f"{name}(method=...) must be 'auto', 'exact' or 'hutchinson', got {method!r}"
            )
        self.method = method

    def bind_graph(self, state: _CurvState, graph: WindowGraph) -> None:
        state.graph = graph
        if self.method != "hutchinson":
            graph.request_backprop_diagonal()

    def _exact(self, graph: WindowGraph) -> bool:
        if self.method == "auto":
            return graph.backprop_ok or graph.dim <= self.exact_max_params
        return self.method == "exact"

    def _exact_meta(self, graph: WindowGraph) -> dict[str, str]:
        how = "second-order backpropagation" if graph.backprop_ok else "one-hot Hessian-vector products"
        return {self.key: "exact", f"{self.key}_method": how}

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(method={self.method!r}, exact_max_params={self.exact_max_params}, "
                f"probes={self.probes})")


class HessTrace(_DiagonalUser):
    """``record["hess_trace"]``: float, tr H of the window objective's Hessian.

    Exact (``record.meta["hess_trace"] == "exact"``): the sum of the diagonal from ceil(D / chunk)
    batched products with one-hot vectors, used while the tracked parameters number at most
    ``exact_max_params`` (default 4096; ``method="exact"`` forces it). Otherwise
    (``"estimated"``) Hutchinson's unbiased estimate with ``probes`` Rademacher vectors v_i:
    mean_i v_i^T H v_i, and ``record["hess_trace_stderr"]`` its standard error,
    std_i(v_i^T H v_i) / sqrt(probes) (unbiased std).
    """

    key = "hess_trace"

    def compute(self, state: _CurvState, graph: WindowGraph) -> None:
        if self._exact(graph):
            state.value = float(graph.diagonal(self.chunk).sum())
            state.meta = self._exact_meta(graph)
            return
        quad, _ = graph.hutchinson(self.probes, self.chunk, self._window_seed())
        state.value = float(quad.mean())
        state.extra = {f"{self.key}_stderr": float(quad.std() / math.sqrt(quad.numel()))}
        state.meta = {self.key: f"estimated: Hutchinson, {self.probes} Rademacher probes"}


class _TIC(_DiagonalUser):
    """TIC (Thomas et al. 2020, cockpit's definitions) from the Hessian diagonal and
    ``m_j = (1/N) sum_n g_nj^2`` (the window's ``sum_grad_squared`` over its N samples)."""

    needs = frozenset({"graph_grad", "sum_grad_squared"})

    def compute(self, state: _CurvState, graph: WindowGraph) -> None:
        """The diagonal at theta_t; the ratio with m_j is formed in finalize, once the window's
        sums of squares are merged."""
        if self._exact(graph):
            diag = graph.diagonal(self.chunk)
            state.meta = self._exact_meta(graph)
        else:
            _, diag = graph.hutchinson(self.probes, self.chunk, self._window_seed())
            state.meta = {self.key: f"estimated: Hutchinson diagonal, {self.probes} Rademacher "
                                    "probes (the ratio of estimates is biased)"}
        state.extra = {"_diag": diag, "_order": [(q, p.numel()) for q, p in graph.params.items()]}

    def finalize(self, stats: WindowStats, state: _CurvState) -> Any:
        self._run(state)
        diag, order = state.extra.pop("_diag", None), state.extra.pop("_order", None)
        if diag is None:
            return None
        dev = diag.device
        m = torch.cat([
            stats.sum_grad_squared[q].detach().double().reshape(-1).to(dev) if q in stats.sum_grad_squared
            else torch.zeros(n, dtype=torch.float64, device=dev)
            for q, n in order
        ]) / max(stats.num_samples, 1)
        return self.ratio(m, diag)


class TICDiag(_TIC):
    """``record["tic_diag"]``: float, sum_j m_j / (H_jj + eps), eps = 1e-7, H_jj the window
    objective's Hessian diagonal (exact or estimated as for :class:`HessTrace`;
    ``record.meta["tic_diag"]`` says which) and m_j = (1/N) sum_n g_nj^2."""

    key = "tic_diag"

    def ratio(self, m: Tensor, diag: Tensor) -> float:
        return float((m / (diag + TIC_EPS)).sum())


class TICTrace(_TIC):
    """``record["tic_trace"]``: float, sum_j m_j / (tr H + eps), eps = 1e-7, tr H the window
    objective's Hessian trace (exact or estimated: ``record.meta["tic_trace"]``) and
    m_j = (1/N) sum_n g_nj^2."""

    key = "tic_trace"

    def ratio(self, m: Tensor, diag: Tensor) -> float:
        return float(m.sum() / (diag.sum() + TIC_EPS))


#: cockpit-for-pytorch's configurations (cockpit/utils/configuration.py), by cockpit's class
#: names; ``None``: no gradlens instrument (``Loss`` is ``record["loss"]`` of every record)
COCKPIT_CONFIGURATIONS = {
    "economy": ["Alpha", "Distance", "GradHist1d", "GradNorm", "InnerTest", "Loss", "NormTest",
                "OrthoTest", "UpdateSize"],
}
COCKPIT_CONFIGURATIONS["business"] = COCKPIT_CONFIGURATIONS["economy"] + ["TICDiag", "HessTrace"]
COCKPIT_CONFIGURATIONS["full"] = COCKPIT_CONFIGURATIONS["business"] + ["HessMaxEV", "GradHist2d"]


def configuration(label: str) -> list[Instrument]:
    """The instruments of cockpit's configuration ``label`` (``"economy"``, ``"business"``,
    ``"full"``), fresh instances with default settings, in cockpit's order. cockpit's ``Loss``
    is every record's ``record["loss"]`` (docs/curvature.md)."""

    if label not in COCKPIT_CONFIGURATIONS:
        raise ValueError(
            f"configuration(label=...) must be 'economy', 'business' or 'full' (cockpit's), got "
            f"{label!r}; e.g. configuration('business')"
        )
    make = {
        "Alpha": Alpha, "GradHist1d": GradHist1d, "GradNorm": GradNorm, "InnerTest": InnerTest,
        "NormTest": NormTest, "OrthoTest": OrthoTest, "TICDiag": TICDiag, "HessTrace": HessTrace,
        "HessMaxEV": HessMaxEV, "GradHist2d": GradHist2d, "Distance": Distance, "UpdateSize": UpdateSize,
    }
    return [make[name]() for name in COCKPIT_CONFIGURATIONS[label] if name in make]
