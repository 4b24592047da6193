"""The Lens: watches a model (and optionally its optimizer), opens and closes windows, runs the
instruments on every captured micro-step, and keeps and streams one record per tracked window.

A window is one real optimizer update (docs/design.md). With an ``optimizer``, the window closes in
the optimizer's step post-hook (with :class:`~gradlens.GradientAccumulateOptimizer` that hook
fires on real updates only); without one, call :meth:`Lens.flush` at the end of each window.
"""

from __future__ import annotations

import functools
import math
import os
import weakref
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import Tensor, nn

from gradlens import ops
from gradlens.capture import (
    LossCall,
    OpUse,
    ParamTap,
    Site,
    Tap,
    is_extended,
    take_loss_calls,
    model_exclusions,
    tracked_parameters,
    trainable_split,
)
from gradlens.distributed import (
    DDPGradRoute,
    MergeContext,
    check_not_sharded,
    is_writer,
    merge_window,
    merge_window_start,
    resolve_group,
)
from gradlens.instruments.base import LIGHT_QUANTITIES, QUANTITIES, Accumulators, Instrument, WindowStats
from gradlens.instruments.noise import sq_norm
from gradlens.kernels import CHUNK_ELEMENTS, Materialised, MaterialisedKernel, OpLinear, add_into, sample_chunks
from gradlens.records import Record

__all__ = ["Lens"]

_LENS_STATE_VERSION = 1


@dataclass
class _MicroStep:
    reduction: str | None  # None until resolved from the losses that backward reached
    batch_size: int | None
    stats: WindowStats
    states: dict[int, Any]
    loss_calls: list = field(default_factory=list)
    explicit: bool = False  # capture(reduction=...) stated the reduction
    loss_value: Tensor | None = None
    seen: set[str] = field(default_factory=set)
    batch_l2: Tensor | None = None
    losses: Tensor | None = None
    #: shared parameters: qualified name -> [B, *param] per-sample gradients summed over uses
    shared: dict[str, Tensor] = field(default_factory=dict)
    #: shared Linear-like uses kept as factors until the micro-step ends: (site, a, delta)
    linear_uses: list = field(default_factory=list)
    grad_sq: Tensor | None = None  # sum over tracked parameters of ||dL/dp||^2 ("micro_grad_sq")
    forwards: set[int] = field(default_factory=set)  # forward passes this backward reached
    backward_done: bool = False
    end_watched: bool = False  # a callback marks backward_done when this backward ends
    empty: bool = False
    factor: Any = None  # capture(multiplier=...): a known factor applied to the loss
    _multiplier: Any = None
    _resolved: bool = False
    _scale: Any = None

    def resolve(self) -> None:
        """Once backward has passed the losses: which of the losses computed since the last
        capture were backpropagated, their reduction, batch size and common multiplier.

        Several loss terms (``ce + 0.01 * mse``): a mean objective if any term is a mean; the
        largest multiplier among the terms is taken as the common one (1/K, a GradScaler scale)
        and divided out, the terms' relative weights being part of the objective; the loss value
        is the backpropagated objective over that multiplier. Order of the terms is irrelevant.
        """
        if self._resolved:
            return
        self._resolved = True
        active = [c for c in self.loss_calls if c.multiplier is not None]
        if self.explicit:
            m = None
            if active:
                m, self.loss_value = active[0].multiplier, active[0].value
            if self.factor is not None:  # a known factor applied on top of the named loss
                m = self.factor if m is None else m * self.factor
            self._multiplier = m
            return
        if not active:
            names = [c.module_name for c in self.loss_calls]
            raise RuntimeError(
                f"none of the losses computed since the last capture ({names}) was "
                "backpropagated in this capture; compute the loss you backpropagate with an "
                "extended loss module, or state its reduction: lens.capture(reduction='mean', loss=loss)"
            )
        self.reduction = "mean" if any(c.reduction == "mean" for c in active) else "sum"
        sizes = {c.batch_size for c in active if c.batch_size is not None}
        if len(sizes) > 1:
            raise ValueError(
                f"the losses of this micro-step saw different batch sizes {sorted(sizes)}; "
                "gradlens needs one sample dimension per micro-step"
            )
        if sizes and self.batch_size is None:
            self.batch_size = sizes.pop()
        if len(active) == 1:
            self._multiplier, self.loss_value = active[0].multiplier, active[0].value
            return
        mults = [c.multiplier.reshape(()).double() for c in active]
        common = torch.stack(mults).max()
        total = sum(m * c.value.double() for m, c in zip(mults, active))
        self._multiplier, self.loss_value = common, total / common

    def scale(self) -> float | Tensor:
        """Output gradients -> per-sample units: B / c under a mean loss, 1 / c under a sum,
        c being what multiplied the loss in backward (1, a GradScaler scale, 1/K, ...)."""
        if self._scale is None:
            self.resolve()
            base = float(self.batch_size) if self.reduction == "mean" else 1.0
            c = self._multiplier
            self._scale = base if c is None else base / c
        return self._scale


def _compile_probe(lens: "Lens"):
    """A forward pre-hook of tracked windows that notes a compiled forward (a plain function
    over a weak reference: deep-copying the model copies no Lens)."""
    import weakref

    ref = weakref.ref(lens)

    def probe(module, args) -> None:
        if torch.compiler.is_compiling():
            owner = ref()
            if owner is not None:
                owner._compiled_seen = True  # an attribute write: traced without a graph break

    return probe


def _ddp_probe(route: DDPGradRoute):
    """A forward pre-hook of tracked windows under torch.distributed: notes the DDP module that
    runs the forward (see :class:`gradlens.distributed.DDPGradRoute`)."""

    def probe(module, args) -> None:
        route.on_forward()

    return probe


class Lens:
    """Per-sample gradient statistics of a model, one :class:`~gradlens.records.Record` per
    tracked window.

    Example::

        model = gradlens.extend(model)
        loss_fn = gradlens.extend(torch.nn.CrossEntropyLoss())
        lens = Lens(model, [BatchL2(), GradNorm(), GradHist1d()], optimizer=opt)
        for i, (x, y) in enumerate(micro_batches):
            loss = loss_fn(model(x), y)
            with lens.capture():
                loss.backward()
            if (i + 1) % K == 0:
                opt.step(); opt.zero_grad()       # closes the window -> lens.records[-1]

    Args:
        model: a model passed through :func:`gradlens.extend`.
        instruments: instances from :mod:`gradlens.instruments` (record keys must be distinct).
        optimizer: the optimizer whose real updates close windows (a ``torch.optim.Optimizer``,
            e.g. :class:`~gradlens.GradientAccumulateOptimizer`); ``None``: call :meth:`flush`.
        every: which windows are tracked: an int ``k`` (windows 0, k, 2k, ...) or a callable
            ``step -> bool``. Untracked windows install no hook and cost nothing.
        exclude: parameter or module names not to track (added to those given to ``extend``).
        log: path of a JSONL file that receives one line per record (see
            :func:`gradlens.load_log`; by default a line holds summaries, see
            :class:`gradlens.sinks.JsonlSink`), or a ``JsonlSink`` (to choose the keys, the
            values written in full, ...).
        log_mode: what a path ``log`` does with an existing file: ``"resume"`` (default)
            appends, and a Lens at step 0 continues counting from the step after the log's
            last record; ``"append"`` appends and keeps this Lens's steps; ``"overwrite"``
            starts a new log. An existing log is never truncated unless asked.
        grad_scaler: the ``torch.amp.GradScaler`` of a loop with a plain ``torch.optim``
            optimizer: a window whose step it skipped (inf/nan) is then dropped, not merged
            into the next (one ``get_scale()`` host read per tracked window). Not needed with
            :class:`~gradlens.GradientAccumulateOptimizer`, which reports skipped windows.
        tensorboard: a ``SummaryWriter`` or a log directory for TensorBoard scalars/histograms.
        keep_records: keep records in :attr:`records`: ``True`` all, ``False`` none, an int
            ``n`` the last ``n`` (long runs: ``False`` or a small ``n`` with ``log``).
        chunk_elements: upper bound on the elements of one materialised slice of per-sample
            gradients ``[b, *param]`` (histograms); memory stays at one such slice per layer
            (default :data:`gradlens.kernels.CHUNK_ELEMENTS`, the one chunking rule of gradlens).
        undefined: what to do with parameters whose per-sample gradients are undefined because
            their output reaches a layer that mixes samples (a BatchNorm in training mode):
            ``"error"`` (default) names them all in one error at the first tracked micro-step;
            ``"exclude"`` leaves them out (see :attr:`tracked`, :attr:`coverage`).
        process_group: under ``torch.distributed`` (e.g. DDP), the ranks whose samples form the
            window: ``None`` (default) merges over the default group when torch.distributed is
            initialised, a ``ProcessGroup`` over that group, ``False`` keeps this rank's own
            records. Merged records describe the global batch of all ranks (samples rank-major),
            are kept on every rank, and are written to the sinks (``log``, ``tensorboard``) by
            rank 0 of the group only. See docs/distributed.md.
        merge: under ``torch.distributed``, when a tracked window's collective runs:
            ``"sync"`` (default) at the update that closes the window, whose record is then
            complete; ``"deferred"`` issues it at that update and lets it run in the background
            during the next window: the record comes one window later (when the next window
            closes, or at :meth:`flush` / :meth:`close` / :meth:`state_dict`), and the step pays
            no rendezvous. Only for instruments of the window gradient (``GradNorm``,
            ``NoiseScaleTwoBatch``), whose next window does not depend on the merged one.
        sinks: more places for the records (after ``log`` and ``tensorboard``): any objects
            with ``write(record)`` and ``close()``. ``write`` is called once per record, in the
            order records become final (a record waiting for the next window, e.g. for
            ``Alpha``, is written when that window closes), ``close`` once by :meth:`close`.
            E.g. :class:`gradlens.integrations.wandb.WandbSink`.

    Attributes:
        records: the records so far (if ``keep_records``).
        tracked: names of the tracked parameters; ``coverage``: their fraction of the model's
            trainable elements (also in ``record.meta["coverage"]``).
        step: index of the current window (number of windows closed so far).
        skipped_windows: windows ended without an update (their statistics are dropped; no
            record): reported by a :class:`~gradlens.GradientAccumulateOptimizer`, or, with a
            plain ``torch.optim`` optimizer and ``grad_scaler=``, seen when the scaler skipped
            the step (its scale fell); a warning says so.
    """

    def __init__(
        self,
        model: nn.Module,
        instruments: Sequence[Instrument],
        optimizer: torch.optim.Optimizer | None = None,
        *,
        every: int | Callable[[int], bool] = 1,
        exclude: Iterable[str] = (),
        log: str | os.PathLike | None = None,
        tensorboard: Any = None,
        keep_records: bool | int = True,
        chunk_elements: int = CHUNK_ELEMENTS,
        undefined: str = "error",
        process_group: Any = None,
        log_mode: str = "resume",
        grad_scaler: Any = None,
        sinks: Iterable[Any] = (),
        merge: str = "sync",
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"Lens(model=...) takes an nn.Module, got {type(model).__name__}")
        model = getattr(model, "_orig_mod", model)  # torch.compile(model): watch the module itself
        if not is_extended(model):
            raise RuntimeError(
                f"the model ({type(model).__name__}) was not extended; call "
                "model = gradlens.extend(model) before creating the Lens"
            )
        check_not_sharded(model)
        other = getattr(model, "_gradlens_lens", None)
        other = other() if other is not None else None
        if other is not None and not other._closed:
            raise RuntimeError(
                f"{type(model).__name__} is already watched by an open Lens ({other!r}); close it "
                "first (lens.close(), or use `with Lens(...) as lens:`), or give one Lens all the "
                "instruments"
            )
        instruments = list(instruments)
        for inst in instruments:
            if not isinstance(inst, Instrument):
                raise TypeError(
                    f"instruments must be gradlens.instruments objects, got {inst!r}; "
                    "did you pass the class instead of an instance, e.g. BatchL2 instead of BatchL2()?"
                )
        for inst in instruments:
            unknown = set(inst.needs) - QUANTITIES
            if unknown:
                raise ValueError(
                    f"{type(inst).__name__}.needs names {sorted(unknown)}, which no capture provides; "
                    f"the quantities are {sorted(QUANTITIES)}"
                )
        keys = [i.key for i in instruments]
        dupes = sorted({k for k in keys if keys.count(k) > 1})
        if dupes:
            raise ValueError(f"two instruments write the same record key(s) {dupes}; keep one of each")
        if isinstance(every, bool) or not (callable(every) or (isinstance(every, int) and every >= 1)):
            raise ValueError(f"every must be an int >= 1 or a callable step -> bool, got {every!r}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if not isinstance(keep_records, (bool, int)) or (
            not isinstance(keep_records, bool) and keep_records < 0
        ):
            raise ValueError(
                f"keep_records must be True, False or an int >= 0 (keep the last n), got {keep_records!r}"
            )
        if log_mode not in ("resume", "append", "overwrite"):
            raise ValueError(
                f"log_mode must be 'resume', 'append' or 'overwrite', got {log_mode!r}"
            )
        if not isinstance(chunk_elements, int) or chunk_elements < 1:
            raise ValueError(f"chunk_elements must be a positive int, got {chunk_elements!r}")
        extra_sinks = _check_sinks(sinks)

        if grad_scaler is not None and not callable(getattr(grad_scaler, "get_scale", None)):
            raise TypeError(
                f"grad_scaler must be a torch.amp.GradScaler, got {type(grad_scaler).__name__}"
            )
        self.grad_scaler = None if hasattr(optimizer, "register_window_end_hook") else grad_scaler
        self._scale_at_open: float | None = None
        self.model = model
        self.instruments = instruments
        self.optimizer = optimizer
        self.every = every
        self.keep_records = keep_records
        self.chunk_elements = chunk_elements
        self.records: list[Record] = []
        self.step = 0
        self.skipped_windows = 0

        if undefined not in ("error", "exclude"):
            raise ValueError(f"undefined must be 'error' or 'exclude', got {undefined!r}")
        self.undefined = undefined
        self._exclude = model_exclusions(model) + tuple(exclude)
        self._undefined_params: dict[str, str] = {}  # left out: name -> the mixing layer
        params = tracked_parameters(model, self._exclude)
        if not params:
            raise ValueError("the model has no trainable parameters left to track after exclusions")
        self._needs = frozenset().union(*(i.needs for i in instruments)) if instruments else frozenset()
        self._per_sample_insts = [i for i in instruments if "per_sample" in i.needs]
        # sampled histograms take entries from the factors; the rest see g_n (or its factors)
        self._sampled_insts = [i for i in self._per_sample_insts if i.sample is not None]
        self._exact_insts = [i for i in self._per_sample_insts if i.sample is None]
        self._layer_insts = [i for i in instruments if "layer" in i.needs]
        self._micro_insts = self._per_sample_insts + [
            i for i in self._layer_insts if i not in self._per_sample_insts
        ]
        # every use goes to instruments that keep delta unscaled with its scale (BatchDot):
        # no per-use ``g * scale`` copy (see gradlens.instruments.crosssample._Layer)
        self._carry_scale = bool(self._layer_insts) and not (self._needs - {"layer"}) and all(
            getattr(i, "carries_scale", False) for i in self._layer_insts
        )
        # instruments of the window gradient only (GradNorm, NoiseScaleTwoBatch): parameter
        # hooks, no per-sample capture, any model
        self._light = not (self._needs - LIGHT_QUANTITIES)
        if self._light:
            self._tap = ParamTap(model, params, self._on_param_grad)
        else:
            self._tap = Tap(
                model,
                params,
                self._on_use,
                self._on_op_use,
                on_weight_grad=self._on_weight_grad if "grad_sum" in self._needs else None,
            )
            # the sum of squares, exact per-sample instruments (histograms) and BatchDot
            # materialise sequence Linear gradients: dL/dW comes from them
            self._tap.fuse_weight_grad = (
                "sum_grad_squared" in self._needs
                or bool(self._exact_insts)
                or any(getattr(i, "fills_weight_grad", False) for i in self._layer_insts)
            )

        self._group = resolve_group(process_group)
        self._merged = False
        if merge not in ("sync", "deferred"):
            raise ValueError(f"merge must be 'sync' or 'deferred', got {merge!r}")
        if merge == "deferred" and not self._light:
            heavy = sorted({type(i).__name__ for i in instruments if set(i.needs) - LIGHT_QUANTITIES})
            raise ValueError(
                f"Lens(merge='deferred') is for instruments of the window gradient only (GradNorm, "
                f"NoiseScaleTwoBatch); {heavy} need per-sample statistics whose next window depends "
                "on the merged one (histogram ranges, Alpha's direction): use merge='sync' (the default)"
            )
        self.merge = merge
        self._merge_pending = None  # the current window's collective, issued and not finished
        self._inflight: tuple | None = None  # (step, window, states, empty micro-steps, merge)
        # under DDP: the global grad_sum from the all-reduced p.grad when that is exact
        self._ddp_route = (
            DDPGradRoute(self._group, light=self._light)
            if self._group is not None and "grad_sum" in self._needs else None
        )
        self._ddp_probe = None
        self._merge_memo: dict = {}  # gathered shapes of the last merge (inline gather)
        # curvature (HessMaxEV, ...): the micro-steps' gradients with their graphs
        self._graph_insts = [i for i in instruments if "graph_grad" in i.needs]
        self._graph = None
        self._grad_sq_hooks = None
        if "micro_grad_sq" in self._needs and not self._light:
            from gradlens.instruments.noise import ParamGradSquares

            self._grad_sq_hooks = ParamGradSquares(list(self._tap.params.values()), self._on_grad_sq)

        self._sinks: list[Any] = []
        writer = is_writer(self._group)  # under torch.distributed: rank 0 writes
        if log is not None and writer:
            from gradlens.sinks import JsonlSink

            sink = log if isinstance(log, JsonlSink) else JsonlSink(
                log, mode="overwrite" if log_mode == "overwrite" else "append"
            )
            self._sinks.append(sink)
            if log_mode == "resume" and sink.next_step is not None:
                self.step = sink.next_step
        if tensorboard is not None and writer:
            from gradlens.sinks import TensorBoardSink

            self._sinks.append(TensorBoardSink(tensorboard))
        self._sinks.extend(extra_sinks)

        self._hooks = []
        if optimizer is not None:
            self._hooks.append(optimizer.register_step_pre_hook(self._on_pre_step))
            self._hooks.append(optimizer.register_step_post_hook(self._on_step))
            if hasattr(optimizer, "register_window_end_hook"):  # GradientAccumulateOptimizer
                self._hooks.append(optimizer.register_window_end_hook(self._on_window_end))
        self._pools: dict[str, dict] = {}  # buffers of large window sums, reused
        self._consumed: set[int] = set()  # forward passes measured by earlier captures
        self._empty_micro_steps = 0
        self._micro: _MicroStep | None = None
        self._pending: tuple[Record, dict[int, Any]] | None = None
        self._compile_probe = None  # a forward pre-hook of tracked windows: is the model compiled?
        self._compiled_seen = False
        self._compile_warned = False
        self._window: WindowStats | None = None
        self._states: dict[int, Any] = {}
        self._closed = False
        model.__dict__["_gradlens_lens"] = weakref.ref(self)  # plain attribute, not a submodule
        self._open_window()

    # ------------------------------------------------------------------ schedule and windows
    def is_tracked(self, step: int | None = None) -> bool:
        """Whether window ``step`` (default: the current one) is tracked."""
        step = self.step if step is None else step
        return bool(self.every(step)) if callable(self.every) else step % self.every == 0

    @property
    def create_graph(self) -> bool:
        """True on tracked windows of a Lens with a curvature instrument: pass it to the
        micro-steps' ``loss.backward(create_graph=lens.create_graph)``."""
        return self._window is not None and bool(self._graph_insts)

    def _open_window(self) -> None:
        if self._graph is not None:  # the previous window's graphs go
            self._graph.release()
            self._graph = None
        if self._merge_pending is not None:  # issued for a window dropped since: every rank waits
            self._merge_pending.finish()
            self._merge_pending = None
        if self.is_tracked():
            self._refresh_params()
            self._window = WindowStats(
                sum_grad_squared=Accumulators(self._pools.setdefault("sum_grad_squared", {})),
                grad_sum=Accumulators(self._pools.setdefault("grad_sum", {})),
            )
            self._states = {id(i): i.start_window() for i in self.instruments}
            if self._graph_insts:
                from gradlens.instruments.curvature import WindowGraph

                self._graph = WindowGraph(self._tap.params, self._group, self.model)
                self._graph.install()
                for i in self._graph_insts:
                    i.bind_graph(self._states[id(i)], self._graph)
            self._window_sites: dict[str, Site] = {}  # every use measured in this window
            self._tap.install()
            if self._grad_sq_hooks is not None:
                self._grad_sq_hooks.install()
            if self._compile_probe is None:
                self._compile_probe = self.model.register_forward_pre_hook(_compile_probe(self))
            if self._ddp_route is not None:
                self._ddp_route.reset()
                if self._ddp_probe is None:
                    self._ddp_probe = self.model.register_forward_pre_hook(_ddp_probe(self._ddp_route))
            if self.grad_scaler is not None:
                self._scale_at_open = float(self.grad_scaler.get_scale())
        else:
            self._window = None
            self._states = {}
            self._tap.remove()
            if self._grad_sq_hooks is not None:
                self._grad_sq_hooks.remove()
            self._remove_compile_probe()
            self._remove_ddp_probe()
        self._merged = False

    def _merge_ranks(self, defer_off: bool = False) -> None:
        """Under torch.distributed: replace this rank's window statistics and instrument states
        by those of all ranks (one all_reduce, plus one all_gather when per-sample vectors are
        kept; see :mod:`gradlens.distributed`). Once per tracked window; nothing otherwise."""
        if self._group is None or self._window is None or self._merged:
            return
        sites = [self._window_sites[n] for n in sorted(self._window_sites)]
        ctx = MergeContext(dict(self._tap.params), sites, self._needs, route=self._ddp_route, memo=self._merge_memo)
        if self.merge == "deferred" and not defer_off:
            self._finish_inflight()  # the previous window's collective came first: finish it first
            self._merge_pending = merge_window_start(self._window, self.instruments, self._states, self._group, ctx)
        else:
            self._window, self._states = merge_window(
                self._window, self.instruments, self._states, self._group, ctx
            )
        self._merged = True

    def _on_grad_sq(self, sq: Tensor) -> None:
        micro = self._micro
        if micro is not None:
            micro.grad_sq = sq if micro.grad_sq is None else micro.grad_sq + sq

    # ------------------------------------------------------------------ coverage
    @property
    def tracked(self) -> list[str]:
        """Qualified names of the tracked parameters (as in ``model.named_parameters()``)."""
        return list(self._tap.params)

    @property
    def coverage(self) -> float:
        """Fraction of the model's trainable elements whose per-sample gradients are tracked."""
        total = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        return sum(p.numel() for p in self._tap.params.values()) / max(total, 1)

    def _refresh_params(self) -> None:
        """Follow parameters frozen, unfrozen or added since the last tracked window."""
        params, total = trainable_split(self.model, self._exclude)  # names checked at build
        for q in self._undefined_params:
            params.pop(q, None)
        if params.keys() != self._tap.params.keys() or any(
            p is not self._tap.params[q] for q, p in params.items()
        ):
            if not params:
                raise ValueError("the model has no trainable parameters left to track")
            self._tap.set_params(params)
            if getattr(self, "_grad_sq_hooks", None) is not None:
                self._grad_sq_hooks.remove()
                self._grad_sq_hooks.params = list(params.values())
        self._window_coverage = sum(p.numel() for p in self._tap.params.values()) / max(total, 1)

    def _check_undefined(self) -> None:
        """Parameters whose output reached a layer that mixes samples (found in the forward)."""
        bad = {q: why for q, why in self._tap.tainted.items() if q in self._tap.params}
        if not bad:
            return
        params = self._tap.params
        total = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        lost = sum(params[q].numel() for q in bad)
        keep = sum(p.numel() for p in params.values()) - lost
        if self.undefined == "exclude":
            self._undefined_params.update(bad)
            rest = {q: p for q, p in params.items() if q not in bad}
            if not rest:
                raise RuntimeError(
                    f"every tracked parameter reaches a layer that mixes samples ({sorted(set(bad.values()))}); "
                    "nothing is left to track: put those layers in eval mode"
                )
            self._tap.set_params(rest)
            self._window_coverage = self.coverage
            return
        layers = sorted(set(bad.values()))
        raise RuntimeError(
            f"per-sample gradients of {len(bad)} parameters ({100 * lost / max(total, 1):.2f}% of the "
            f"trainable elements) are undefined: their output reaches {', '.join(layers)}, which "
            f"mixes the samples of a micro-batch: {sorted(bad)}. Put those layers in eval mode, or "
            f"leave these parameters out with Lens(..., undefined='exclude') and track the other "
            f"{100 * keep / max(total, 1):.2f}% (each such layer's own weight and bias and everything "
            "after it stay exact)"
        )

    def _on_pre_step(self, optimizer, args, kwargs):
        if self._window is None:
            return None
        # args[0] is the optimizer itself (torch passes step's full positional arguments)
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if callable(closure):
            # optimizer.step(closure) (PyTorch Lightning): the closure runs this window's last
            # micro-step inside step(), after this hook; snapshot once it has run, just before
            # the update.
            def closure_then_snapshot(*a, **k):
                out = closure(*a, **k)
                if not done:
                    done.append(True)
                    self._before_update()
                return out

            done: list[bool] = []
            if "closure" in kwargs:
                return args, {**kwargs, "closure": closure_then_snapshot}
            return (args[0], closure_then_snapshot, *args[2:]), kwargs
        self._before_update()
        return None

    def _before_update(self) -> None:
        if self._window is not None:
            self._merge_ranks()
            for i in self.instruments:
                i.before_update(self._states[id(i)])

    def _on_step(self, optimizer, args, kwargs) -> None:
        if self._window is not None:
            for i in self.instruments:
                i.after_update(self._states[id(i)])
        self._close_window()

    def flush(self) -> Record | None:
        """Close the current window as if the optimizer had updated: emit its record (if it is
        tracked and captured anything) and start the next window. Returns the record."""
        self._check_open()
        return self._close_window(sync=True)

    def _close_window(self, sync: bool = False) -> Record | None:
        if sync:
            self._finish_inflight()
        self._merge_ranks(defer_off=sync)
        record = None
        if self._merge_pending is not None:  # merge="deferred": the record comes with the next window
            self._inflight = (self.step, self._window, self._states, self._empty_micro_steps, self._merge_pending)
            self._merge_pending = None
        else:
            record = self._emit(self.step, self._window, self._states, self._empty_micro_steps)
        self.step += 1
        self._empty_micro_steps = 0
        self._open_window()
        return record

    def _finish_inflight(self) -> Record | None:
        """merge="deferred": wait for the previous window's collective and emit its record."""
        if self._inflight is None:
            return None
        step, window, states, empty, pending = self._inflight
        self._inflight = None
        window, states = pending.finish()
        return self._emit(step, window, states, empty)

    def _emit(self, step: int, window: WindowStats | None, states: dict[int, Any], empty: int) -> Record | None:
        """The record of a closed window (merged across ranks when distributed), to
        :attr:`records` and the sinks; None if it was not tracked or captured nothing."""
        record = None
        captured = window is not None and bool(window.micro_steps)
        self._settle_pending(
            None if captured else f"window {step} (the next one) was not tracked or captured nothing",
            states,
        )
        if captured:
            values = {i.key: i.finalize(window, states[id(i)]) for i in self.instruments}
            for i in self.instruments:
                values.update(i.extra(states[id(i)]))
            loss_value = window.window_loss()
            values["loss"] = None if math.isnan(loss_value) else loss_value
            record = Record(step, window.num_samples, window.micro_steps, values)
            record.meta["coverage"] = self._window_coverage  # as of the window's opening
            if values["loss"] is None:
                record.meta["loss"] = (
                    "unknown: a functional loss without loss=; use lens.capture(reduction=..., loss=loss)"
                )
            if empty:
                record.meta["empty_micro_steps"] = empty
            record.meta["units"] = (
                "g_n = B_k * d(micro-step objective)_n (mean objective)"
                if window.reduction == "mean"
                else "g_n = d(micro-step objective)_n (sum objective)"
            )
            for i in self.instruments:
                record.meta.update(i.meta(states[id(i)]))
            self._warn_nonfinite(record)
            deferring = {id(i): states[id(i)] for i in self.instruments if i.defers(states[id(i)])}
            for i in self.instruments:
                i.end_window(states[id(i)])
            if self.keep_records is True or self.keep_records > 0:
                self.records.append(record)
                if self.keep_records is not True and len(self.records) > self.keep_records:
                    del self.records[: len(self.records) - self.keep_records]
            if deferring:  # e.g. Alpha: completed by the next window, then written to the sinks
                self._pending = (record, deferring)
            else:
                for sink in self._sinks:
                    sink.write(record)
        return record

    def discard_window(self) -> None:
        """Drop the current window's statistics without a record, for an update the training
        framework skipped (e.g. a GradScaler found inf/nan gradients and did not call the
        optimizer): the next micro-steps start a fresh window with the same step index, and
        :attr:`skipped_windows` counts it."""
        self._check_open()
        self._on_window_end(None, False)

    def _on_window_end(self, optimizer, updated: bool) -> None:
        """A window the optimizer ended without an update (GradScaler inf/nan, ``reset()``): its
        statistics must not leak into the next window, and there is no record of it (the
        parameters did not move; the update index stays the same)."""
        if not updated:
            self.skipped_windows += 1
            self._open_window()

    def _remove_ddp_probe(self) -> None:
        if self._ddp_probe is not None:
            self._ddp_probe.remove()
            self._ddp_probe = None

    def _remove_compile_probe(self) -> None:
        if self._compile_probe is not None:
            self._compile_probe.remove()
            self._compile_probe = None

    def _warn_compiled(self) -> None:
        if self._light:  # parameter hooks only: no layer output is hooked, no graph break
            return
        if self._compiled_seen and not self._compile_warned:
            self._compile_warned = True
            warnings.warn(
                "the model runs under torch.compile: in a tracked window gradlens hooks every "
                "watched layer's output, and each hook is a graph break (a 3-layer MLP: 6), so "
                "tracked windows run partly uncompiled and recompile when tracking starts or "
                "stops; untracked windows install no hook and stay fully compiled. Track fewer "
                "windows (Lens(..., every=k)) to keep the cost small. (Said once per Lens.)",
                RuntimeWarning,
                stacklevel=4,
            )

    def _warn_nonfinite(self, record: Record) -> None:
        """A record with inf/nan gradients behind a real update: with a plain optimizer and a
        GradScaler that the Lens does not know, an earlier skipped window was merged here."""
        if self.optimizer is None or hasattr(self.optimizer, "register_window_end_hook"):
            return
        if self.grad_scaler is not None:
            return
        gn, l2 = record.get("grad_norm"), record.get("batch_l2")
        bad = (isinstance(gn, float) and not math.isfinite(gn)) or (
            isinstance(l2, Tensor) and not bool(torch.isfinite(l2).all())
        )
        if bad:
            warnings.warn(
                f"the record of window {record.step} holds inf/nan per-sample gradients although "
                "the optimizer updated: if a GradScaler skipped an earlier step, that window was "
                "merged into this one; pass Lens(..., grad_scaler=scaler) so skipped windows are "
                "dropped",
                RuntimeWarning,
                stacklevel=3,
            )

    def _drop_window_skipped_by_scaler(self) -> None:
        """With a plain ``torch.optim`` optimizer, ``GradScaler.step`` skips the optimizer's
        step on inf/nan (no hook fires) and ``scaler.update()`` lowers the scale. Seen at the
        next capture through the public ``get_scale()``: the scale fell since the window
        opened, so that window was not applied. Drop it (no record, ``skipped_windows += 1``,
        a warning) instead of merging it into the next."""
        scaler = self.grad_scaler
        if scaler is None or self._window is None or not self._window.micro_steps:
            return
        if self._scale_at_open is None or not float(scaler.get_scale()) < self._scale_at_open:
            return
        self.skipped_windows += 1
        warnings.warn(
            f"window {self.step} was dropped: the GradScaler skipped its optimizer step "
            f"(inf/nan; the scale fell to {float(scaler.get_scale())}); no record, "
            f"lens.skipped_windows={self.skipped_windows}",
            RuntimeWarning,
            stacklevel=4,
        )
        self._open_window()  # as for a window a GradientAccumulateOptimizer skipped

    def _settle_pending(self, reason: str | None, closing: dict[int, Any] | None = None) -> None:
        """Complete the pending record from the window now closing (its states ``closing``,
        used when ``reason is None``) or mark what it lacks, then write it to the sinks."""
        if self._pending is None:
            return
        record, states = self._pending
        self._pending = None
        closing = self._states if closing is None else closing
        for i in self.instruments:
            if id(i) in states:
                i.settle(record, states[id(i)], None if reason else closing[id(i)], reason)
        for sink in self._sinks:
            sink.write(record)

    # ------------------------------------------------------------------ capture
    @contextmanager
    def capture(
        self,
        reduction: str | None = None,
        losses: Tensor | None = None,
        *,
        multiplier: float | Tensor | None = None,
        loss: Tensor | None = None,
    ) -> Iterator[None]:
        """Context manager around one micro-step's ``loss.backward()``.

        The loss reduction and batch size come from the last forward pass of a loss module
        passed through :func:`gradlens.extend`, or of a loss function (``F.cross_entropy``, ...)
        called inside the model's forward (``model(x, labels=y).loss``). For a functional loss
        computed outside the model pass ``reduction="mean"|"sum"`` (the batch size is read
        from the model's input), and ``loss=`` the loss tensor if what you backpropagate is a
        multiple of it (``(loss / K).backward()``): the multiplier is then divided out.

        Units (docs/design.md): with ``L`` the micro-step's objective split by sample, g_n = B * dL_n
        for a mean objective (a token-mean language-model loss, ignored targets included) and
        dL_n for a sum; ``record.meta["units"]`` says which.
        ``losses``: optional per-sample losses ``[B]`` of this micro-step.

        What multiplied the loss on its way to ``backward`` (a GradScaler's scale, the ``1/K``
        of a framework that divides the loss by the accumulation count) must be divided out to
        get per-sample gradients. An extended loss module measures it by itself. With
        ``reduction=`` (a functional loss, or a loss computed inside the model) say it with:

        Args:
            multiplier: a known factor (positive float, or 0-d tensor) by which the
                backpropagated objective was multiplied relative to the loss of this micro-step
                (or relative to ``loss``, when given); e.g. ``1 / K``.
            loss: the 0-d loss tensor as computed, before any such scaling; gradlens hooks it and
                divides out whatever multiplies it between it and ``backward`` (measured in
                backward, no host sync). Backward must pass through it.
        """
        self._check_open()
        if loss is not None and reduction is None:
            raise ValueError("lens.capture(loss=...) needs the loss's reduction: capture(reduction='mean', loss=loss)")
        multiplier = _check_multiplier(reduction, multiplier, loss)
        calls = take_loss_calls()
        if self._window is None:  # untracked window: nothing to do, nothing to pay
            yield
            return
        if self._micro is not None:
            raise RuntimeError("lens.capture() is already active; captures cannot be nested")
        self._drop_window_skipped_by_scaler()
        self._warn_compiled()
        if reduction is not None:
            if reduction not in ("mean", "sum"):
                raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
            if loss is not None:  # the user names the loss: what multiplies it is divided out
                if not (isinstance(loss, Tensor) and loss.dim() == 0):
                    raise TypeError(f"loss must be the 0-d loss tensor, got {type(loss).__name__}")
                calls = [LossCall(reduction=reduction, batch_size=None, output=loss, module_name="loss")]
            elif multiplier is not None:  # a known factor already applied to the loss
                calls = []
            elif calls:  # a loss computed inside the model (or an extended one): it knows more
                reduction = None
            else:
                raise ValueError(
                    f"lens.capture(reduction={reduction!r}) needs the loss tensor too, so that "
                    "whatever multiplies it before backward (a 1/K, a constant, a GradScaler "
                    f"scale) is divided out instead of changing the units: "
                    f"lens.capture(reduction={reduction!r}, loss=loss) with loss the unscaled loss"
                )
        elif not calls:
            raise RuntimeError(
                "no loss passed through gradlens.extend() ran since the last capture; "
                "wrap the loss module (loss_fn = gradlens.extend(torch.nn.CrossEntropyLoss())) "
                "or state the reduction: lens.capture(reduction='mean')"
            )
        expected = reduction
        if expected is None and len({c.reduction for c in calls}) == 1:
            expected = calls[0].reduction  # known before backward in the usual one-loss case
        if expected is not None:
            self._check_reduction(expected)
        micro = _MicroStep(
            reduction=reduction,
            batch_size=calls[0].batch_size if len(calls) == 1 else None,
            stats=WindowStats(reduction=expected or "mean"),
            states={id(i): i.start_micro(self._states[id(i)]) for i in self._micro_insts},
            loss_calls=calls,
            explicit=reduction is not None,
            losses=losses,
        )
        for call in calls:
            call.watch_multiplier()
        micro.factor = multiplier
        if self._tap.tainted:
            self._check_undefined()
        if self._ddp_route is not None:
            self._ddp_route.start_micro(self._tap.params)
        self._micro = micro
        try:
            yield
            if micro.seen:
                self._finish_micro(micro)
        except BaseException:
            # Sums of this window are accumulated in place: a micro-step that failed half way
            # invalidates the whole window. Drop it (no record) and let the error through.
            if micro.seen:
                warnings.warn(
                    f"an exception inside lens.capture() interrupted window {self.step}; its "
                    "statistics are dropped",
                    RuntimeWarning,
                    stacklevel=3,
                )
                self._open_window()
            raise
        finally:
            self._micro = None
            self._tap.reset_micro()
            if micro.forwards:  # bounded: forward ids only grow
                self._consumed.update(micro.forwards)
                newest = max(self._consumed)
                self._consumed = {f for f in self._consumed if f > newest - 64}
        if micro.empty:
            self._empty_micro_steps += 1
            return
        if not micro.seen:
            raise RuntimeError(
                "lens.capture() exited without a backward pass through the watched model; "
                "call loss.backward() inside the with-block"
            )
        if micro.explicit and micro.loss_calls and micro.loss_calls[0].multiplier is None:
            self._open_window()  # the window's sums used an unknown scale: drop them
            raise RuntimeError(
                "lens.capture(loss=...): backward did not pass through the given loss tensor, "
                "so what multiplied it is unknown; pass the tensor that is backpropagated (or "
                "scaled and then backpropagated), or state multiplier= instead"
            )
        self._fold(micro)

    def _check_reduction(self, reduction: str) -> None:
        if self._window.micro_steps and self._window.reduction != reduction:
            raise ValueError(
                f"this micro-step's loss uses reduction={reduction!r} but the window's earlier "
                f"micro-steps used {self._window.reduction!r}; use one reduction per window"
            )

    def _fold(self, micro: _MicroStep) -> None:
        micro.resolve()
        b = micro.batch_size
        if self._graph is not None:
            try:
                self._graph.end_micro(micro.scale(), b, micro.reduction)
            except RuntimeError:  # no graph (create_graph=False): the window is dropped
                self._open_window()
                raise
        s = micro.stats
        s.reduction = micro.reduction
        s.num_samples, s.micro_steps = b, 1
        if micro.loss_value is not None:
            v = micro.loss_value.double()
            s.loss_sum = v * b if micro.reduction == "mean" else v
        elif micro.losses is not None:
            s.loss_sum = micro.losses.detach().double().sum()
        else:
            s.loss_sum = torch.tensor(float("nan"), dtype=torch.float64)
        if micro.batch_l2 is not None:
            s.batch_l2 = [micro.batch_l2]
        if micro.grad_sq is not None:  # ||s_k||^2 = (per-sample scale)^2 ||dL/dtheta||^2
            scale = micro.scale()
            s.micro_grad_sq = micro.grad_sq * (scale * scale)
            s.micro_size_sq = float(b) ** 2
        self._window = self._window.merge(s)
        skipped = [q for q in self._tap.params if q not in micro.seen]  # g_n = 0 for these
        for inst in self._per_sample_insts:
            for q in skipped:
                inst.update_zeros(micro.states[id(inst)], q, self._tap.params[q], b)
        for inst in self._micro_insts:
            key = id(inst)
            inst.micro_done(micro.states[key], b, micro.reduction, micro.losses)
            self._states[key] = inst.merge(self._states[key], micro.states[key])
        note = getattr(self.optimizer, "note_micro_batch", None)  # GradientAccumulateOptimizer
        if note is not None:
            note(b)  # its step(num_samples=...) must agree
        if self._ddp_route is not None:
            self._ddp_route.end_micro(self._tap.params, micro.scale())

    def _on_weight_grad(self, w: Site, grad: Tensor | None) -> None:
        """Autograd's dL/dW of a Linear call (see :func:`gradlens.capture._weight_grad_node`):
        sum_n g_n of the weight is that times the per-sample scale; no extra matmul."""
        micro = self._micro
        if micro is None or grad is None or self._window is None:
            return
        key = w.params.get("weight")
        if key is None or key not in self._tap.params or self._tap.uses[key] > 1:
            return
        self._add_grad_sum(key, grad, micro.scale())

    def _add_grad_sum(self, key: str, grad: Tensor, scale: float | Tensor) -> None:
        """``grad_sum[key] += scale * grad`` (a buffer of the pool on the first add)."""
        with torch.no_grad():
            acc = self._window.grad_sum
            if key in acc:
                if isinstance(scale, Tensor):
                    acc[key].addcmul_(grad, scale)
                else:
                    acc[key].add_(grad, alpha=scale)
                return
            dtype = grad.dtype if grad.dtype in (torch.float32, torch.float64) else torch.float32
            out = acc.buffer(key, tuple(grad.shape), grad.to(dtype) if dtype != grad.dtype else grad)
            acc[key] = torch.mul(grad, scale, out=out)

    def _on_param_grad(self, q: str, grad: Tensor) -> None:
        """Light capture (:class:`~gradlens.capture.ParamTap`): dL/dp of parameter ``q`` in this
        backward, before it reaches ``p.grad``: the micro-step's squared norm and the window's
        gradient sum, in per-sample units."""
        if self._window is None:
            return
        micro = self._in_backward(q)
        if micro is None:
            return
        if not micro.seen:  # the first gradient of this backward
            micro.resolve()
            if micro.batch_size is None:
                micro.batch_size = self._tap.batch
            if micro.batch_size is None:
                raise RuntimeError(
                    "gradlens found no batch size for this micro-step: neither an extended loss "
                    "module nor the model's forward saw the input; compute the loss with "
                    "gradlens.extend(loss_fn), or run the forward through the watched model"
                )
            if micro.reduction is not None:
                self._check_reduction(micro.reduction)
            if micro.batch_size == 0:
                micro.empty = True
        micro.seen.add(q)
        if micro.empty:
            return
        g = grad.detach()
        if g.is_sparse:
            g = g.to_dense()
        if "micro_grad_sq" in self._needs:
            sq = sq_norm(g)
            micro.grad_sq = sq if micro.grad_sq is None else micro.grad_sq + sq
        if "grad_sum" in self._needs:
            self._add_grad_sum(q, g, micro.scale())

    def _in_backward(self, what: str) -> _MicroStep | None:
        """The micro-step whose backward just reached ``what`` (a use, or a parameter): inside
        a capture, its first backward (whose end is then watched)."""
        micro = self._micro
        if micro is None and self._graph is not None and self._graph.busy:
            return None  # the curvature instruments' Hessian-vector products: not a micro-step
        if micro is None:
            raise RuntimeError(
                f"backward reached {what!r} outside lens.capture() during a tracked window; wrap "
                "the backward: with lens.capture(): loss.backward()"
            )
        if micro.backward_done:
            raise RuntimeError(
                "a second backward() inside one lens.capture(): each micro-step's backward needs "
                "its own capture (with lens.capture(): loss.backward())"
            )
        if not micro.end_watched:
            micro.end_watched = True
            torch.autograd.Variable._execution_engine.queue_callback(lambda: setattr(micro, "backward_done", True))
        return micro

    def _begin_use(self, what: str, batch: int, forward: int) -> _MicroStep | None:
        """Checks at each use reaching backward; None: nothing to measure (an empty batch)."""
        micro = self._in_backward(what)
        if micro is None:
            return None
        if forward in self._consumed:
            raise RuntimeError(
                f"this backward reached {what!r} of a forward pass that an earlier lens.capture() "
                "already measured (a graph backpropagated twice, retain_graph=True): its samples "
                "would count twice; run a new forward pass for each captured micro-step"
            )
        micro.forwards.add(forward)
        if batch == 0:
            micro.empty = True
        if micro.empty:
            return None
        if self._tap.tainted:
            self._check_undefined()
        micro.resolve()
        if micro.reduction is not None:
            self._check_reduction(micro.reduction)
        if micro.batch_size is None:
            micro.batch_size = batch
        elif batch != micro.batch_size:
            raise RuntimeError(
                f"the loss saw a batch of {micro.batch_size} but the model's input had {batch} "
                f"samples (at {what!r}); gradlens needs the first dimension of the loss input and "
                "of the model's first input to be the sample dimension"
            )
        return micro

    @staticmethod
    def _dtype(g: Tensor) -> torch.dtype:
        return g.dtype if g.dtype in (torch.float32, torch.float64) else torch.float32

    def _on_use(self, site: Site, a: Tensor, g: Tensor, weight_via_node: bool, batch: int, forward: int,
                weight_grad=None) -> None:
        """Backward reached a closed-form use: measure it, or keep it if its parameters are
        shared (their g_n is the sum over uses, measured when the micro-step ends).
        ``weight_grad``: the :class:`~gradlens.capture.WeightGrad` of a fused Linear call, to
        fill with dL/dW if the measurement forms the per-sample weight gradients."""
        micro = self._begin_use(site.name, batch, forward)
        if micro is None:
            return
        tap = self._tap
        names = {attr: q for attr, q in site.params.items() if q in tap.params}
        if not names:
            return
        with torch.no_grad():
            dtype = self._dtype(g)
            raw = g.detach().to(dtype)
            scale = micro.scale()
            a = a.detach()
            if a.is_floating_point():
                a = a.to(dtype)
            micro.seen.update(names.values())
            single = {attr for attr, q in names.items() if tap.uses[q] <= 1}
            shared = set(names) - single
            # per-sample units; kept unscaled (with the scale) where only BatchDot reads it
            delta = raw * scale if shared or not self._carry_scale else None
            if single:
                wg = (weight_grad, scale) if weight_grad is not None and "weight" in single else None
                if delta is None:
                    self._measure(site.only(single), a, raw, micro, False, wg, scale=scale)
                else:
                    self._measure(site.only(single), a, delta, micro, weight_via_node and "weight" in single, wg)
            if shared:
                part = site.only(shared)
                if part.kernel.kind == "linear":
                    micro.linear_uses.append((part, a, delta))
                else:
                    self._add_shared(micro, part, a, delta)

    def _add_shared(self, micro: _MicroStep, site: Site, a: Tensor, delta: Tensor) -> None:
        pending = [attr for attr, q in site.params.items() if q not in micro.shared]
        got = site.kernel.per_sample(site.module, a, delta, 0, delta.shape[0], attrs=pending) if pending else {}
        for attr, q in site.params.items():
            if q in micro.shared:  # a later use: added in place (no [B, *param] temporary)
                site.kernel.add_per_sample(site.module, a, delta, attr, micro.shared[q])
            else:  # owned: later uses add into it, and a, delta may be kept by other measurements
                g = got[attr]
                micro.shared[q] = g.clone() if _shares_storage(g, a) or _shares_storage(g, delta) else g

    def _on_op_use(self, use: OpUse, g: Tensor) -> None:
        """Backward reached an operation where parameters meet the batch: per-sample gradients
        of each parameter through the exact per-operation rule (see :mod:`gradlens.ops`)."""
        micro = self._begin_use(use.name, use.batch, use.forward)
        if micro is None:
            return
        tap = self._tap
        dtype = self._dtype(g)
        delta = (g.detach().to(dtype) * micro.scale())
        per_q: dict[str, Tensor] = {}
        for pos, t, names in use.inputs:
            names = [q for q in names if q in tap.params]
            if not names:
                continue
            params = [tap.params[q] for q in names]
            direct = ops.batched_lookup(use.func, use.args, use.kwargs, pos, t, params, delta, use.axis)
            if direct is not None:  # a lookup of ids that span the batch: no [B, *t.shape]
                add_into(per_q, names[0], direct.detach())
                continue
            gt = ops.per_sample_wrt(use.func, use.args, use.kwargs, pos, t, delta, use.axis)
            if len(names) == 1 and t is tap.params[names[0]]:
                got = [gt]
            else:
                got = ops.chain_to_params(t, [tap.params[q] for q in names], gt.to(t.dtype))
            for q, gq in zip(names, got):
                if gq is not None:
                    add_into(per_q, q, gq.detach().to(dtype))
        with torch.no_grad():
            for q, gq in per_q.items():
                micro.seen.add(q)
                if tap.uses[q] <= 1:
                    self._measure_materialised(f"{use.name}:{q}", q, gq, micro)
                else:
                    add_into(micro.shared, q, gq)

    def _measure_materialised(self, name: str, q: str, g: Tensor, micro: _MicroStep) -> None:
        site = Site(name, Materialised("p", self._tap.params[q]), MaterialisedKernel(), {"p": q})
        self._measure(site, g, g.new_zeros(g.shape[0]), micro)

    def _finish_micro(self, micro: _MicroStep) -> None:
        """After backward: measure the shared parameters (sum over their uses) and check that
        every tracked parameter that received a gradient was measured."""
        with torch.no_grad():
            groups: dict[tuple, list] = {}
            for site, a, delta in micro.linear_uses:
                groups.setdefault(tuple(sorted(site.params.items())), []).append((site, a, delta))
            owners: dict[str, int] = {}
            for key in groups:
                for _, q in key:
                    owners[q] = owners.get(q, 0) + 1
            for key, uses in groups.items():
                mixed = any(owners[q] > 1 or q in micro.shared for _, q in key)
                if mixed:
                    for site, a, delta in uses:
                        self._add_shared(micro, site, a, delta)
                    continue
                site0 = uses[0][0]
                b = uses[0][2].shape[0]
                a = torch.cat([u[1].reshape(b, -1, u[1].shape[-1]) for u in uses], dim=1)
                d = torch.cat([u[2].reshape(b, -1, u[2].shape[-1]) for u in uses], dim=1)
                m = site0.module
                attrs = tuple(attr for attr, _ in key)
                stand_in = OpLinear(m.weight, getattr(m, "bias", None), attrs)
                name = "+".join(q for _, q in key) + "#uses"
                self._measure(Site(name, stand_in, site0.kernel, dict(key)), a, d, micro)
            for q, g in micro.shared.items():
                self._measure_materialised(f"{q}#uses", q, g, micro)
        micro.linear_uses, micro.shared = [], {}
        if self._light:
            return
        tap = self._tap
        missing = sorted(q for q in tap.received if q in tap.params and q not in micro.seen)
        if missing:
            raise RuntimeError(
                f"the tracked parameters {missing} received a gradient in this backward, but "
                "no use of them inside the model's forward was measured (a parameter used only "
                "outside model(...), e.g. in a loss term, has no per-sample gradient); exclude "
                f"them: Lens(..., exclude={missing!r})"
            )

    def _measure(
        self, w: Site, a: Tensor, delta: Tensor, micro: _MicroStep, weight_via_node: bool = False,
        weight_grad=None, scale=None,
    ) -> None:
        """Measure one use: ``a`` the layer input, ``delta`` the output gradient in per-sample
        units (both batch-first). ``weight_grad``: ``(WeightGrad, per-sample scale)`` of a
        fused Linear call, handed to the kernel's reduction (which may fill it). ``scale``
        (a Lens that carries it, see ``_carry_scale``): ``delta`` is unscaled and every
        instrument receives it with its scale."""
        if scale is not None:
            self._window_sites[w.name] = w
            for inst in self._layer_insts:
                fill = weight_grad is not None and weight_grad[0].value is None and inst.fills_weight_grad
                inst.update_layer(micro.states[id(inst)], w, a, delta, weight_grad=weight_grad if fill else None,
                                  scale=scale)
            return
        self._window_sites[w.name] = w
        kernel, module, needs, window = w.kernel, w.module, self._needs, self._window
        per_sample = bool(self._per_sample_insts)
        # Quantities with a factor formula (Linear) never materialise; the rest come from the
        # per-sample pass when one runs anyway, else from the kernel's own reduction.
        from_chunks = set()
        if not getattr(kernel, "factored", False):  # one materialising pass serves them all
            from_chunks = needs & {"batch_l2", "sum_grad_squared", "grad_sum"}
        want = (needs & {"batch_l2", "sum_grad_squared", "grad_sum"}) - from_chunks
        if want:
            # sums go straight into the window's accumulators (in place, no per-step copies)
            acc = {"sum_grad_squared": window.sum_grad_squared, "grad_sum": window.grad_sum}
            if weight_grad is not None:
                acc["weight_grad"] = weight_grad
            skip = {("grad_sum", "weight")} if weight_via_node else ()
            l2 = kernel.reduce(module, a, delta, want, w.params, acc, skip)
            if l2:
                self._add_l2(micro, sum(l2))
        for inst in self._layer_insts:
            if weight_grad is not None and weight_grad[0].value is None and getattr(inst, "fills_weight_grad", False):
                inst.update_layer(micro.states[id(inst)], w, a, delta, weight_grad=weight_grad)
            else:
                inst.update_layer(micro.states[id(inst)], w, a, delta)
        if not (per_sample or from_chunks):
            return
        done: set[tuple[int, str]] = set()
        # Sampled histograms draw their entries from the layer's factors: no materialisation.
        for inst in self._sampled_insts:
            for attr, qname in w.params.items():
                draw = functools.partial(kernel.entries, module, a, delta, attr)
                inst.update_sampled(micro.states[id(inst)], qname, self._tap.params[qname], draw,
                                    delta.shape[0])
                done.add((id(inst), attr))
        # Rank-one weights (Linear): instruments with a factor fast path skip materialisation.
        factors = kernel.outer_factors(module, a, delta) if self._exact_insts else {}
        for attr, (d2, a2) in factors.items():
            if attr in w.params:
                qname = w.params[attr]
                for inst in self._exact_insts:
                    if inst.update_outer(micro.states[id(inst)], qname, self._tap.params[qname], d2, a2):
                        done.add((id(inst), attr))
        attrs = [
            attr
            for attr in w.params
            if from_chunks or any((id(i), attr) not in done for i in self._per_sample_insts)
        ]
        if not attrs:
            return
        numel = sum(getattr(module, attr).numel() for attr in attrs)
        l2_parts = []
        # a fused Linear call not yet given its dL/dW: the sum of the slices formed here
        fill = weight_grad is not None and weight_grad[0].value is None and "weight" in attrs
        wsum = delta.new_zeros(module.weight.shape) if fill else None
        for s, e in sample_chunks(numel, delta.shape[0], self.chunk_elements):
            chunk = kernel.per_sample(module, a, delta, s, e, attrs=attrs)
            l2 = 0
            if wsum is not None:
                wsum.view(1, -1).addmm_(delta.new_ones(1, e - s), chunk["weight"].reshape(e - s, -1))
            for attr in attrs:
                gb = chunk[attr]
                qname = w.params[attr]
                param = self._tap.params[qname]
                for inst in self._per_sample_insts:
                    if (id(inst), attr) not in done:
                        inst.update(micro.states[id(inst)], qname, param, gb)
                sq = gb.square() if from_chunks & {"batch_l2", "sum_grad_squared"} else None  # once
                if "batch_l2" in from_chunks:
                    l2 = l2 + sq.flatten(1).sum(1)
                if "sum_grad_squared" in from_chunks:
                    add_into(window.sum_grad_squared, qname, sq.sum(0))
                if "grad_sum" in from_chunks:
                    add_into(window.grad_sum, qname, gb.sum(0))
            if "batch_l2" in from_chunks:
                l2_parts.append(l2)
        if l2_parts:
            self._add_l2(micro, torch.cat(l2_parts))
        if wsum is not None:
            holder, scale = weight_grad
            holder.value = (wsum / scale).to(module.weight.dtype)

    @staticmethod
    def _add_l2(micro: _MicroStep, l2: Tensor) -> None:
        l2 = l2.double()
        micro.batch_l2 = l2 if micro.batch_l2 is None else micro.batch_l2 + l2

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume this Lens in a fresh process, exactly.

        Holds the window index ``step`` (the schedule's position), ``skipped_windows``, each
        instrument's own state between windows (adaptive histogram ranges, Alpha's last update
        direction), the pending record (Alpha's record waits for the next window) and, when
        saved mid-window, the partial window itself (the sums, per-sample norms, histogram counts
        and factors of the micro-steps captured so far). Save it together with the model's and
        the optimizer's state dicts (a :class:`~gradlens.GradientAccumulateOptimizer` saves its
        own partial window); a new Lens on the loaded model then gives the same records as the
        run that was not interrupted.

        Format: ``{"version", "step", "skipped_windows", "blob"}``; ``blob`` is a uint8 tensor
        (a pickle in which parameters, watched layers and instruments are referred to by name or
        position), so ``torch.save`` / ``torch.load(weights_only=True)`` carry it. Like any
        pickle, load only checkpoints you trust.
        """
        import io
        import pickle

        self._finish_inflight()  # merge="deferred": the window in flight gets its record first
        ids = self._object_ids()
        payload = {
            "instruments": [
                {k: v for k, v in vars(i).items() if k not in getattr(i, "_not_saved", ())}
                for i in self.instruments
            ],
            "window": self._window,
            "states": [self._states.get(id(i)) for i in self.instruments] if self._window else None,
            "pending": None,
        }
        if self._pending is not None:
            record, states = self._pending
            payload["pending"] = (
                record,
                {n: states[id(i)] for n, i in enumerate(self.instruments) if id(i) in states},
            )

        class _Pickler(pickle.Pickler):
            def persistent_id(self, obj):
                return ids.get(id(obj))

        buf = io.BytesIO()
        _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(payload)
        return {
            "version": _LENS_STATE_VERSION,
            "step": self.step,
            "skipped_windows": self.skipped_windows,
            "blob": torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (of a Lens with the same instruments on the same
        model). The records, the log lines and the pending record continue where the saved
        Lens stopped.

        Raises:
            TypeError / ValueError: not a gradlens Lens state dict, another version, other
                instruments, or parameters / layers this Lens does not track.
        """
        import io
        import pickle

        self._check_open()
        if not isinstance(state_dict, dict) or "blob" not in state_dict:
            raise TypeError(
                "Lens.load_state_dict(state_dict=...) takes the dict from Lens.state_dict(), got "
                f"{type(state_dict).__name__}"
            )
        if state_dict.get("version") != _LENS_STATE_VERSION:
            raise ValueError(
                f"Lens state_dict version {state_dict.get('version')!r}; this gradlens reads "
                f"version {_LENS_STATE_VERSION}"
            )
        objs = {pid: obj for obj, pid in self._object_ids(by_pid=True)}

        class _Unpickler(pickle.Unpickler):
            def persistent_load(self, pid):
                if pid not in objs:
                    kind = {"p": "parameter", "w": "watched layer", "m": "module", "i": "instrument"}
                    raise ValueError(
                        f"the Lens state_dict refers to {kind.get(pid[0], pid[0])} {pid[1]!r}, "
                        "which this Lens does not have; build it on the same model with the "
                        "same instruments (in the same order) and exclusions"
                    )
                return objs[pid]

        blob = state_dict["blob"].cpu().numpy().tobytes()
        payload = _Unpickler(io.BytesIO(blob)).load()
        saved = payload["instruments"]
        if len(saved) != len(self.instruments):
            raise ValueError(
                f"the Lens state_dict has {len(saved)} instruments, this Lens {len(self.instruments)}; "
                "create the Lens with the same instruments in the same order"
            )
        for inst, attrs in zip(self.instruments, saved):
            inst.__dict__.update(attrs)
        self.step = int(state_dict["step"])
        self.skipped_windows = int(state_dict["skipped_windows"])
        self._open_window()
        if payload["window"] is not None:
            if self._window is None:
                raise ValueError(
                    f"the Lens state_dict was saved inside tracked window {self.step}, which this "
                    "Lens's schedule (every=...) does not track; use the same schedule"
                )
            self._window = payload["window"]
            self._states = {id(i): st for i, st in zip(self.instruments, payload["states"])}
            for i in self._graph_insts:  # curvature: this Lens' graph of the window (empty)
                i.bind_graph(self._states[id(i)], self._graph)
        self._pending = None
        if payload["pending"] is not None:
            record, states = payload["pending"]
            self._pending = (record, {id(self.instruments[n]): st for n, st in states.items()})

    def _object_ids(self, by_pid: bool = False):
        """Objects a saved state refers to by name: tracked parameters, watched layers, the
        model's modules, the instruments and the buffer pools."""
        pairs = [(self._pools, ("pools", ""))]
        pairs += [(p, ("p", q)) for q, p in self._tap.params.items()]
        pairs += [(m, ("m", n)) for n, m in self.model.named_modules()]
        pairs += [(i, ("i", str(n))) for n, i in enumerate(self.instruments)]
        if by_pid:
            return pairs
        return {id(obj): pid for obj, pid in pairs}

    # ------------------------------------------------------------------ lifecycle
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Lens was closed; create a new one")

    def close(self, write_pending: bool = True) -> None:
        """Remove every hook this Lens added and close its sinks (idempotent). Records stay.

        A pending record (Alpha waits for the next window) is written, marked as missing what
        the next window would have given; ``write_pending=False`` drops it instead (stopping a
        run that a Lens will resume from :meth:`state_dict`, which holds it)."""
        if self._closed:
            return
        self._finish_inflight()
        if write_pending:
            self._settle_pending("the Lens was closed before the next window closed")
        self._pending = None
        self._closed = True
        if getattr(self.model, "_gradlens_lens", None) is not None and self.model._gradlens_lens() is self:
            del self.model.__dict__["_gradlens_lens"]
        self._tap.remove()
        if self._graph is not None:
            self._graph.release()
            self._graph = None
        if self._grad_sq_hooks is not None:
            self._grad_sq_hooks.remove()
        self._remove_compile_probe()
        self._remove_ddp_probe()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for sink in self._sinks:
            sink.close()

    def __enter__(self) -> "Lens":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Lens({type(self.model).__name__}, {self.instruments!r}, step={self.step}, "
            f"tracked={len(self._tap.params)} parameters, coverage={100 * self.coverage:.1f}%)"
        )



# ---------------------------------------------------------------------- sinks and multipliers
def _shares_storage(t: Tensor, other: Tensor) -> bool:
    """Whether ``t`` is a view into ``other``'s memory (e.g. a 2-D Linear's per-sample bias
    gradient, which is its output gradient itself)."""
    return t.untyped_storage().data_ptr() == other.untyped_storage().data_ptr()


def _check_sinks(sinks: Iterable[Any]) -> list[Any]:
    """The ``sinks=`` argument of :class:`Lens` as a list; every entry must have callable
    ``write(record)`` and ``close()`` (the sink protocol)."""
    if sinks is None or isinstance(sinks, (str, bytes)) or not isinstance(sinks, Iterable):
        raise TypeError(
            f"Lens(sinks=...) takes a list of sinks (objects with write(record) and close()), "
            f"got {type(sinks).__name__} {sinks!r}"
        )
    out = list(sinks)
    for sink in out:
        missing = [m for m in ("write", "close") if not callable(getattr(sink, m, None))]
        if missing:
            raise TypeError(
                f"Lens(sinks=[...]): {type(sink).__name__} {sink!r} lacks {' and '.join(m + '()' for m in missing)}; "
                "a sink is any object with write(record) and close() (see gradlens.sinks), e.g. "
                "gradlens.sinks.JsonlSink(path) or gradlens.integrations.wandb.WandbSink()"
            )
    return out


def _check_multiplier(reduction, multiplier, loss) -> float | Tensor | None:
    """Checks capture()'s multiplier= and loss= arguments; returns the multiplier (detached)."""
    if multiplier is None and loss is None:
        return None
    if reduction is None:
        raise ValueError(
            "lens.capture(multiplier=..., loss=...) go with a stated reduction "
            "(lens.capture(reduction='mean', ...)); with a loss module passed through "
            "gradlens.extend() the multiplier is measured by itself: drop them"
        )
    if multiplier is not None:
        if isinstance(multiplier, Tensor):
            if multiplier.dim() != 0 or not multiplier.is_floating_point():
                raise ValueError(
                    "lens.capture(multiplier=...) must be a positive number or a 0-d float tensor, "
                    f"got a {multiplier.dtype} tensor of shape {tuple(multiplier.shape)}"
                )
            multiplier = multiplier.detach()
        elif isinstance(multiplier, bool) or not isinstance(multiplier, (int, float)) or not (
            0 < multiplier < float("inf")
        ):
            raise ValueError(
                f"lens.capture(multiplier=...) must be a positive finite number (e.g. 1 / K), got "
                f"{multiplier!r}"
            )
    if loss is not None:
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            what = f"shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else type(loss).__name__
            raise ValueError(
                f"lens.capture(loss=...) must be the 0-d loss tensor that is backpropagated, got {what}"
            )
        if not loss.requires_grad:
            raise ValueError(
                "lens.capture(loss=...) does not require grad, so backward cannot pass through "
                "it; pass the loss before .detach()/.item()"
            )
    return multiplier
