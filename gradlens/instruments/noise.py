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

Three routes (the first two produce S, Q, T):

* :class:`NoiseScaleTwoBatch`, an instrument of the :class:`~gradlens.Lens`: hooks on the
  tracked parameters see each micro-step's gradient before it is added to ``p.grad`` (and, under
  DDP, before it is all-reduced), so the small batches are the micro-batches of every rank;
  T comes from the window's ``grad_sum`` (under DDP with equal batch sizes, read from DDP's
  all-reduced ``p.grad``, so the merge sends only a few scalars:
  :class:`gradlens.distributed.merge.DDPGradRoute`).
* :class:`NoiseScaleMonitor`, on a :class:`~gradlens.GradientAccumulateOptimizer`: reads
  ``p.grad`` at every micro-step and the running window sum (a few dot products per micro-step,
  no extra memory, one host sync per window); works for any model, no Lens needed.
* :class:`NoiseScaleDDP`, on a ``DistributedDataParallel`` module: small batches are the ranks'
  own gradients, the big batch DDP's average of them; the estimator works from that average
  (:func:`rank_average_estimates`, unbiased for any per-rank sizes); one small all_reduce per
  ``sync_every`` windows, no Lens.
"""

from __future__ import annotations

import collections
import math
import weakref
from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from gradlens import compat
from gradlens.training.accumulate import GradientAccumulateOptimizer
from gradlens.distributed.fsdp import check_monitor as check_fsdp_monitor
from gradlens.instruments.base import Instrument
from gradlens.capture.dtensor import is_dtensor
from gradlens.compat import dtensor_local
from gradlens.core.side import in_side_backward
from gradlens.core.stats import WindowStats
from gradlens.core.sq_norms import sq_norm, sum_sq as _sum_sq
from gradlens.core.state_checks import COUNT, FLOAT, check_state, is_float
from gradlens.core.counter import WindowCounter

__all__ = ["NoiseScaleTwoBatch", "NoiseScaleMonitor", "NoiseScaleDDP", "ParamGradSquares", "two_batch_estimates", "rank_average_estimates"]


def two_batch_estimates(S: float, Q: float, T: float, N: float) -> tuple[float, float]:
    """``(|G|^2_est, tr(Sigma)_est)`` from S = sum_k ||s_k||^2, Q = sum_k B_k^2, T = ||sum_k s_k||^2
    and N = sum_k B_k (module docstring); NaN, NaN when N^2 <= Q (a single small batch)."""
    den = N * N - Q
    if not den > 0:
        return math.nan, math.nan
    return (T - S) / den, (N * N * S - Q * T) / (N * den)


#: a smoothing factor as :class:`_Smoother` takes it (a state's check)
_BETA = (lambda v: is_float(v) and 0.0 <= v < 1.0, "a number in [0, 1)")


class _Smoother:
    """EMAs of |G|^2 and tr(Sigma) across windows (windows without estimates are skipped); the
    bias corrections of the two averages are equal, so their ratio needs none."""

    def __init__(self, beta: float):
        if not _BETA[0](beta):
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
    return _estimates_record(g2, tr, Q, N, M, smoother)


def _estimates_record(g2: float, tr: float, Q: float, N: float, M: int, smoother: _Smoother) -> dict[str, Any]:
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

    # ---- checkpoints (gradlens.lens.state) ----------------------------------------------------
    def state_dict(self) -> dict:
        """``beta`` (checked on load) and the moving averages ``grad_sq_ema`` and
        ``trace_sigma_ema`` (the keys of :meth:`NoiseScaleDDP.state_dict`)."""
        sm = self._smoother
        return {"beta": sm.beta, "grad_sq_ema": sm.g2, "trace_sigma_ema": sm.tr}

    def load_state_dict(self, state: dict) -> None:
        check_state(self, state, {"grad_sq_ema": FLOAT, "trace_sigma_ema": FLOAT},
                    same={"beta": self._smoother.beta})
        self._smoother.g2 = float(state["grad_sq_ema"])
        self._smoother.tr = float(state["trace_sigma_ema"])


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
        if not in_side_backward():  # (a per-sample gradient formed inside the capture: not this backward's)
            # (tensor parallelism: this rank's block; the TP fold sums the blocks)
            self.on_sq(sq_norm(dtensor_local(grad) if is_dtensor(grad) else grad))


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
        if not isinstance(optimizer, GradientAccumulateOptimizer):
            raise TypeError(
                "NoiseScaleMonitor(optimizer=...) needs a gradlens.GradientAccumulateOptimizer (it "
                f"sees each micro-step's gradient), got {type(optimizer).__name__}; wrap it: "
                "GradientAccumulateOptimizer(opt, accum_steps=K), or use the Lens instrument "
                "NoiseScaleTwoBatch"
            )
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
            raise ValueError(f"ranks must be an int >= 1 (data-parallel ranks), got {ranks!r}")
        check_fsdp_monitor([p for g in optimizer.param_groups for p in g["params"]], "NoiseScaleMonitor")
        if callback is not None and not callable(callback):
            raise TypeError(f"callback must be callable(values) or None, got {type(callback).__name__}")
        self.optimizer = optimizer
        self.ranks = ranks
        self.callback = callback
        self._smoother = _Smoother(beta)
        self.values: list[dict[str, Any]] = []
        self._counter = WindowCounter()  # the window's small batches: M micro-steps, N samples
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
        self._counter.clear()

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
        scale = compat.optimizer_grad_scale(optimizer)  # set by a GradScaler for this step
        if scale is not None:
            f = w / scale.double()
        s_sq = sq * (f * f)
        self._S = s_sq if self._S is None else self._S + s_sq
        self._Q += b * b
        self._counter.note_micro(b)

    @torch.no_grad()
    def _on_window_grad(self, optimizer) -> None:
        """T = ||s||^2, s = sum_k s_k, from the window gradient G the wrapper just wrote (before
        clipping): under "mean" G = sum_k B_k grad_k / sum_k B_k (unscaled), so s = N * G
        (N = sum_k b_k, all ranks); under "sum" s = R * G."""
        if self._S is None:
            return
        sq = _sum_sq([optimizer.window_grad(p) for group in optimizer.param_groups for p in group["params"]])
        if sq is not None:
            f = self._counter.samples if optimizer.reduction == "mean" else float(self.ranks)
            self._T = sq * (f * f)

    def _on_window_end(self, optimizer, updated: bool) -> None:
        window = self._counter
        if updated and self._S is not None:
            vals = _values(float(self._S), self._Q, float(self._T), window.samples, window.micro_steps, self._smoother)
            self.values.append(vals)
            if self.callback is not None:
                self.callback(vals)
        self._reset()
        window.close(updated)

    def remove(self) -> None:
        """Detach from the optimizer (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles = []


def rank_average_estimates(
    A: float, U: float, R: int, sum_a: float, sum_a2: float, sum_b: float
) -> tuple[float, float]:
    """``(|G|^2_est, tr(Sigma)_est)`` from R data-parallel ranks' gradients and their average
    (the :class:`NoiseScaleDDP` estimator, unbiased for any per-rank batch sizes).

    Rank r holds ``g_r = s_r / w_r`` (``s_r`` its gradient sum over B_r samples; w_r = B_r for a
    mean loss, 1 for a sum), so E g_r = a_r G and Cov g_r = b_r Sigma with a_r = B_r / w_r and
    b_r = B_r / w_r^2; DDP writes u = (1/R) sum_r g_r. With A = sum_r ||g_r||^2 and U = ||u||^2,
    E[A] = sum a_r^2 |G|^2 + sum b_r tr and E[R^2 U] = (sum a_r)^2 |G|^2 + sum b_r tr, so

        |G|^2_est = (R^2 U - A) / ((sum a_r)^2 - sum a_r^2),
        tr_est    = (A - sum a_r^2 |G|^2_est) / sum b_r.

    NaN, NaN for one rank. With equal B_r = b this is the paper's pair for b and N = R b.
    """
    den = sum_a * sum_a - sum_a2
    if not (den > 0 and sum_b > 0):
        return math.nan, math.nan
    g2 = (R * R * U - A) / den
    return g2, (A - sum_a2 * g2) / sum_b


class NoiseScaleDDP:
    """The two-batch noise scale of DistributedDataParallel training: small batches = each
    rank's own gradient (before DDP's all-reduce), big batch = the all-reduced one. Any model, no
    Lens, no per-sample kernel; DDP's all-reduce is untouched (no comm hook).

    Each synchronised backward is one window. This rank's ``||p.grad||^2`` is read before DDP
    writes the reduced gradient (a dot product per parameter: at the end of the backward, while
    DDP's last all-reduce is in flight; with ``gradient_as_bucket_view=True``, whose ``p.grad``
    is DDP's bucket, or in a static graph's first iteration, in hooks right after each gradient
    is accumulated); after DDP has written the averaged gradient (the same on every rank), each rank
    takes the squared norm of its 1/R share of it. The per-rank numbers of ``sync_every``
    windows (seven each, the shares of ``||p.grad||^2`` summed by it) travel in **one** small all_reduce
    of DDP's process group, issued by every rank at the same backward, after which ``values``
    gains their records (estimator: :func:`rank_average_estimates`). So records arrive in
    batches of ``sync_every`` windows; :meth:`flush` (called on every rank) sends the rest.

    Example::

        ddp = DistributedDataParallel(model)
        noise = NoiseScaleDDP(ddp, batch_size=64)      # samples per rank per synchronised backward
        ...  loss_fn(ddp(x), y).backward(); opt.step(); opt.zero_grad()
        noise.flush()                                   # every rank, e.g. before reading at the end
        noise.values[-1]["b_simple_smoothed"]

    Under ``ddp.no_sync()`` accumulation the window is all micro-batches up to the synchronised
    one: ``batch_size`` counts them all, and ``p.grad`` must then be their mean gradient
    (``reduction="mean"``: each micro-batch's mean loss divided by the number of micro-batches)
    or their sum (``"sum"``). Every rank may use its own ``batch_size`` (set the attribute before
    a window to change it); the estimates stay unbiased, though DDP's average then weights the
    ranks' samples unequally. GradScaler scales are divided out (``scaler=``); a window with an
    inf/NaN gradient gives NaN values, skipped by the smoothing.

    Args:
        ddp: the ``torch.nn.parallel.DistributedDataParallel`` module (2+ ranks, no comm hook,
            no DDP mixed precision).
        batch_size: this rank's samples per window.
        reduction: ``"mean"`` (default) or ``"sum"``: what ``p.grad`` holds on each rank.
        beta: EMA factor of the smoothing across windows (default 0.9).
        sync_every: windows per all_reduce (default 10; the same on every rank).
        scaler: a ``torch.amp.GradScaler`` whose scale multiplies the gradients, or None.
        callback: optional ``callback(values: dict)`` per window as its record arrives.
        history: records kept in ``values`` (the newest; default 10000).

    Attributes:
        values: a deque of dicts with the keys of :class:`NoiseScaleTwoBatch`'s record value
            (``small_batches`` = R) and ``"window"``, the window's index from 0.
    """

    def __init__(
        self,
        ddp: Any,
        *,
        batch_size: float,
        reduction: str = "mean",
        beta: float = 0.9,
        sync_every: int = 10,
        scaler: Any = None,
        callback: Callable[[dict[str, Any]], None] | None = None,
        history: int = 10_000,
    ):
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(ddp, torch.nn.Module) and not isinstance(ddp, DistributedDataParallel):
            check_fsdp_monitor(list(ddp.parameters()), "NoiseScaleDDP")
        if not isinstance(ddp, DistributedDataParallel):
            raise TypeError(
                "NoiseScaleDDP(ddp, ...) needs the torch.nn.parallel.DistributedDataParallel module "
                f"(it reads each rank's gradient before DDP's all-reduce), got {type(ddp).__name__}; "
                "without DDP use NoiseScaleMonitor on a GradientAccumulateOptimizer"
            )
        world = dist.get_world_size(ddp.process_group)
        if world < 2:
            raise ValueError(
                f"NoiseScaleDDP needs 2 or more ranks (its small batches are the ranks' batches), this "
                f"DDP has {world}; with one process accumulate micro-batches and use NoiseScaleMonitor"
            )
        _check_plain_ddp(ddp)
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum' (what p.grad holds), got {reduction!r}")
        for name, v in (("sync_every", sync_every), ("history", history)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if callback is not None and not callable(callback):
            raise TypeError(f"callback must be callable(values) or None, got {type(callback).__name__}")
        if scaler is not None and not (hasattr(scaler, "get_scale") and hasattr(scaler, "is_enabled")):
            raise TypeError(f"scaler must be a torch.amp.GradScaler or None, got {type(scaler).__name__}")
        # weakly, and its process group not at all: the hooks on the DDP's parameters hold this
        # monitor, so a strong reference would leave the DDP (or the group) to the garbage
        # collector at interpreter exit, after destroy_process_group, which can abort the process
        self._ddp = weakref.ref(ddp)
        self.world = world
        self.batch_size = batch_size
        self.reduction = reduction
        self.sync_every = sync_every
        self.scaler = scaler
        self.callback = callback
        self._smoother = _Smoother(beta)
        self.values: collections.deque = collections.deque(maxlen=history)
        ignored = set(getattr(ddp, "parameters_to_ignore", ()) or ())
        self.params = [p for n, p in ddp.module.named_parameters() if p.requires_grad and n not in ignored]
        self._share = _rank_share(self.params, dist.get_rank(ddp.process_group), world)
        self._windows = 0  # windows whose rows were sent
        self._pending: list[tuple[Tensor, tuple[float, ...]]] = []  # ([A_r, U share], sizes)
        self._armed = False
        self._started = False
        self._local: Tensor | None = None
        self._bucket_view = bool(getattr(ddp, "gradient_as_bucket_view", False))
        self._in_hooks = self._bucket_view
        self._handles = [ddp.register_forward_pre_hook(self._on_forward)]
        self._handles += [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    @property
    def batch_size(self) -> float:
        return self._batch_size

    @batch_size.setter
    def batch_size(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"batch_size must be a positive number (this rank's samples per window), got {value!r}")
        self._batch_size = float(value)

    @property
    def ddp(self) -> Any:
        """The DistributedDataParallel module (None once it is freed; held weakly)."""
        return self._ddp()

    def __repr__(self) -> str:
        return (f"NoiseScaleDDP(ranks={self.world}, batch_size={self._batch_size:g}, reduction={self.reduction!r}, "
                f"sync_every={self.sync_every}, pending={len(self._pending)})")

    # ---- hooks ----------------------------------------------------------------------------
    def _on_forward(self, module, args) -> None:
        if torch.is_grad_enabled():
            ddp = self._ddp()
            if compat.ddp_join_enabled(ddp):
                raise RuntimeError(
                    "NoiseScaleDDP does not run under torch.distributed.algorithms.Join (a rank that "
                    "has joined skips the backwards, and with them this monitor's collective): call "
                    "noise.flush() and noise.remove() before entering Join, or give every rank the "
                    "same number of batches"
                )
            self._armed = compat.ddp_grad_sync(ddp)
            # where this rank's gradient is read: in the hooks when p.grad is DDP's bucket, or
            # when DDP reduces in a callback queued before the backward's first hook (a static
            # graph's first iteration; parameters whose all-reduce DDP delays); else at the end
            self._in_hooks = (
                self._bucket_view
                or bool(compat.ddp_delayed_params(ddp))
                or compat.ddp_static_graph_pending(ddp)
            )

    def _on_grad(self, p: Tensor) -> None:
        # runs right after p.grad is accumulated, before DDP's own hook of p marks it ready
        if not self._armed or p.grad is None:
            return
        first = not self._started
        self._started = True
        if self._in_hooks:  # DDP may reduce p.grad before the backward ends (see _on_forward): read it now
            sq = sq_norm(p.grad)
            self._local = sq if self._local is None else self._local + sq
        if first:
            # runs when the backward is done, before DDP's finalize (queued later in this backward)
            compat.queue_backward_callback(self._before_finalize)

    @torch.no_grad()
    def _before_finalize(self) -> None:
        if not self._in_hooks:
            # DDP reduces copies of the gradients and writes p.grad in its finalize, which runs
            # after this: p.grad is still this rank's, and these dot products overlap DDP's
            # all-reduces still in flight
            self._local = _sum_sq([p.grad for p in self.params])
        compat.queue_backward_callback(self._end_window)

    @torch.no_grad()
    def _end_window(self) -> None:
        local, self._local, self._armed, self._started = self._local, None, False, False
        if local is None:
            return
        # DDP's average, written by its finalize, is the same on every rank: each rank takes the
        # squared norm of its 1/R share of it, and the all_reduce sums the shares
        avg = _sum_sq([None if p.grad is None else p.grad.reshape(-1)[lo:hi] for p, lo, hi in self._share])
        if avg is None:
            avg = local.new_zeros(())
        scale = self._scale()
        if scale is not None:
            inv = scale.double().reciprocal().square()
            local, avg = local * inv, avg * inv
        b = self._batch_size
        a, bb = (1.0, 1.0 / b) if self.reduction == "mean" else (b, b)
        self._pending.append((torch.stack([local, avg]), (b, b * b, a, a * a, bb)))
        if len(self._pending) >= self.sync_every:
            self.flush()

    def _scale(self) -> Tensor | None:
        # the scale of this backward (the update comes later)
        return None if self.scaler is None else compat.grad_scaler_scale(self.scaler)

    # ---- records --------------------------------------------------------------------------
    def flush(self) -> list[dict[str, Any]]:
        """Send the pending windows' numbers (one all_reduce; call on every rank at the same
        point, between backwards) and return their records (also appended to ``values``)."""
        import torch.distributed as dist

        if not self._pending:
            return []
        ddp = self._ddp()
        if ddp is None:
            raise RuntimeError(
                "NoiseScaleDDP.flush(): its DistributedDataParallel module was freed (this monitor "
                "holds it weakly), so its process group is gone; flush before dropping the DDP module"
            )
        _check_plain_ddp(ddp)
        pending, self._pending = self._pending, []
        norms = torch.stack([r[0] for r in pending])
        rows = torch.tensor([r[1] for r in pending], dtype=torch.float64, device=norms.device)
        buf = torch.cat([rows, norms], dim=1)
        dist.all_reduce(buf, group=ddp.process_group)
        out = []
        for row in buf.tolist():
            N, Q, sa, sa2, sb, A, U = row
            g2, tr = rank_average_estimates(A, U, self.world, sa, sa2, sb)
            vals = _estimates_record(g2, tr, Q, N, self.world, self._smoother)
            vals["window"] = self._windows
            self._windows += 1
            self.values.append(vals)
            out.append(vals)
            if self.callback is not None:
                self.callback(vals)
        return out

    def state_dict(self) -> dict[str, Any]:
        """The smoothing state and window count (pending windows are not in it: flush first,
        on every rank, to keep them)."""
        sm = self._smoother
        return {"beta": sm.beta, "grad_sq_ema": sm.g2, "trace_sigma_ema": sm.tr, "windows": self._windows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s dict (its ``beta`` too); a dict that lacks or adds
        keys, or holds values no monitor writes, is a :class:`~gradlens.lens.state.StateDictError`
        before anything is set."""
        check_state(self, state, {"beta": _BETA, "grad_sq_ema": FLOAT, "trace_sigma_ema": FLOAT,
                                  "windows": COUNT})
        self._smoother = _Smoother(state["beta"])
        self._smoother.g2 = float(state["grad_sq_ema"])
        self._smoother.tr = float(state["trace_sigma_ema"])
        self._windows = int(state["windows"])

    def remove(self) -> None:
        """Remove the hooks (idempotent); pending windows are dropped (flush first to keep them)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._pending = []


def _rank_share(params: list[Tensor], rank: int, world: int) -> list[tuple[Tensor, int, int]]:
    """``(p, lo, hi)`` flat element ranges of ``params`` making up rank ``rank``'s 1/world share
    of all their elements (contiguous in parameter order; the shares of all ranks tile them)."""
    total = sum(p.numel() for p in params)
    start, stop = total * rank // world, total * (rank + 1) // world
    out, off = [], 0
    for p in params:
        lo, hi = max(start - off, 0), min(stop - off, p.numel())
        if lo < hi:
            out.append((p, lo, hi))
        off += p.numel()
    return out


def _check_plain_ddp(ddp: Any) -> None:
    """Refuse a DDP whose all-reduced ``p.grad`` is not the plain average of the ranks' gradients."""
    why = compat.ddp_average_departure(ddp)
    if why is not None:
        raise ValueError(
            f"NoiseScaleDDP reads DDP's averaged gradient from p.grad; this DDP has {why}, which "
            "changes it: remove it, or use the Lens instrument NoiseScaleTwoBatch"
        )
