"""The Lens: watches a model (and optionally its optimizer), opens and closes windows, starts and
ends each captured micro-step on its :class:`~gradlens.measure.meter.Meter` (which measures the uses
for the instruments), and keeps and streams one record per tracked window.

A window is one real optimizer update (docs/design.md). With an ``optimizer``, the window closes in
the optimizer's step post-hook (with :class:`~gradlens.GradientAccumulateOptimizer` that hook
fires on real updates only); without one, call :meth:`Lens.flush` at the end of each window.

The Lens keeps the windows, their schedule, the optimizer hooks, the glue of rank merging, the
sinks and the lifecycle; the rest are modules it calls: :mod:`gradlens.lens.checks` (its
arguments), :mod:`gradlens.core.counter` (the window counters), :mod:`gradlens.lens.record` (a closed
window's record, the pending record), :mod:`gradlens.lens.rank_merge` (sync / deferred merging),
:mod:`gradlens.lens.amp` (windows a GradScaler skipped), :mod:`gradlens.lens.compiled` (torch.compile),
:mod:`gradlens.lens.curvature_graph` (the curvature instruments' graph), :mod:`gradlens.lens.state`
(checkpoints).
"""

from __future__ import annotations

import os
import weakref
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import Tensor, nn

from gradlens.lens.amp import ScalerSkips, warn_nonfinite
from gradlens.capture.tracked import model_exclusions, trainable_split
from gradlens.capture.losses import take_loss_calls
from gradlens.compat import compiled_in_place, compiled_original
from gradlens.lens.compiled import CompileNotice, end_micro, finish_micro, make_route, open_tracked, route_meta
from gradlens.lens.probes import ForwardProbes
from gradlens.lens.curvature_graph import CurvatureGraph
from gradlens.distributed.merge import DEFAULT_TIMEOUT_S, is_writer
from gradlens.lens.optimizers import after_closure, unwrap_optimizer  # imports no framework
from gradlens.core.groups import check_groups
from gradlens.distributed.fsdp import presenting
from gradlens.distributed.deepspeed import ZeroView, resolve as resolve_deepspeed
from gradlens.instruments.base import Instrument
from gradlens.core.window import Window
from gradlens.core.param_shapes import full_numel, tracked_fraction
from gradlens.core.limits import CHUNK_ELEMENTS
from gradlens.distributed.pipeline import resolve_pipeline
from gradlens.lens.pipeline import pipeline_capture, rank_merge
from gradlens.lens.checks import (began_unseen, capture_error, check_instruments, check_options, check_sinks, data_group,
                                  meter_layout, tp_fold, tp_writer, tracked_at_build, watched_model)
from gradlens.measure.meter import Meter, Plan
from gradlens.core.records import Record
from gradlens.output.sinks import JsonlSink, SinkSet
from gradlens.lens.state import lens_state_dict, load_lens_state_dict
from gradlens.capture.units import check_multiplier
from gradlens.core.counter import WindowCounter, counter_property
from gradlens.training.accum_optimizer import GradientAccumulateOptimizer
from gradlens.lens.record import PendingRecord, end_window, keep_record, window_record
from gradlens.lens.optimizer_grads import OptimizerGrads
from gradlens.lens.stated import StatedFactors

__all__ = ["Lens"]


def _setting(holder: str, name: str, doc: str) -> property:
    """A setting of the Lens kept by one of its parts: ``lens.<attr>`` reads and sets
    ``lens.<holder>.<name>`` (``holder`` may be dotted)."""
    def part(lens):
        for attr in holder.split("."):
            lens = getattr(lens, attr)
        return lens

    return property(lambda lens: getattr(part(lens), name), lambda lens, value: setattr(part(lens), name, value),
                    doc=doc)


class Lens:
    """Per-sample gradient statistics of a model, one :class:`~gradlens.core.records.Record` per
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
        model: a model passed through :func:`gradlens.extend`; or a pipeline's ``ScheduleGPipe``
            / ``Schedule1F1B`` (or ``PipelineStage``) whose stage module was (docs/distributed.md).
        instruments: instances from :mod:`gradlens.instruments` (record keys must be distinct).
        optimizer: the optimizer whose real updates close windows (a ``torch.optim.Optimizer``,
            e.g. :class:`~gradlens.GradientAccumulateOptimizer`); ``None``: call :meth:`flush`.
        every: which windows are tracked: an int ``k`` (windows 0, k, 2k, ...) or a callable
            ``step -> bool``. Untracked windows install no hook and cost nothing.
        exclude: parameter or module names not to track (added to those given to ``extend``).
        log: path of a JSONL file that receives one line per record (see
            :func:`gradlens.load_log`; by default a line holds summaries, see
            :class:`gradlens.output.sinks.JsonlSink`), or a ``JsonlSink`` (to choose the keys, the
            values written in full, ...).
        log_mode: what a path ``log`` does with an existing file: ``"resume"`` (default; or its
            older name ``"append"``) appends a new *segment*: a fresh Lens starts a new run, a
            Lens loaded from a checkpoint at step ``s`` continues the last run and replaces its
            records ``>= s`` (:func:`gradlens.load_log`, docs/long_runs.md); ``"overwrite"``
            starts a new log. One Lens writes a log at a time (a lock on the file).
        grad_scaler: the ``torch.amp.GradScaler`` of a loop with a plain ``torch.optim``
            optimizer: a window whose step it skipped (inf/nan) is then dropped, not merged
            into the next (one ``get_scale()`` host read per tracked window). Not needed with
            :class:`~gradlens.GradientAccumulateOptimizer`, which reports skipped windows.
        tensorboard: a ``SummaryWriter`` or a log directory for TensorBoard scalars/histograms.
        keep_records: keep records in :attr:`records`: ``True`` all, ``False`` none, an int
            ``n`` the last ``n`` (long runs: ``False`` or a small ``n`` with ``log``).
        chunk_elements: upper bound on the elements of one materialised slice of per-sample
            gradients ``[b, *param]`` (histograms); memory stays at one such slice per layer
            (default :data:`gradlens.core.limits.CHUNK_ELEMENTS`; on the CPU a slice
            is further capped at :data:`~gradlens.core.limits.CPU_SLICE_ELEMENTS`).
        undefined: what to do with parameters whose per-sample gradients are undefined because
            their output reaches a layer that mixes samples (a BatchNorm in training mode):
            ``"error"`` (default) names them all in one error at the first tracked micro-step;
            ``"exclude"`` leaves them out (see :attr:`tracked`, :attr:`coverage`);
            ``"contribution"`` measures each sample's contribution to its micro-step's gradient
            instead, not its own gradient (``record.meta["contribution"]``; docs/instruments.md).
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
        sinks: more places for the records (after ``log`` and ``tensorboard``): objects with
            ``write(record)`` (once per record, in the order records become final) and
            ``close()`` (once, by :meth:`close`), e.g. :class:`gradlens.integrations.wandb.WandbSink`.
            A sink that raises warns and does not stop training; its missed records are written
            again, and after 3 failures in a row it is dropped (:class:`gradlens.output.sinks.SinkSet`).
        groups: per-group statistics (``record.groups[group][key]``, next to the totals):
            ``None`` (default) totals only; ``"param"`` one group per tracked parameter (its
            qualified name); ``"module"`` one per module that owns parameters directly (its
            qualified name, ``"(model)"`` for the root's own); a dict group name -> list of
            ``fnmatch`` patterns over parameter names (a parameter joins the first group it
            matches; the unmatched form ``"other"``). Shared parameters count once, under
            their first name. Every instrument value that decomposes over parameters (its
            class sets ``per_group``) gets one value per group; see :mod:`gradlens.core.groups`.
        timeout: under ``torch.distributed``, seconds each collective of the Lens waits, then raises
            naming the window (default 300 s; ``None``: the process group's own). When built, the Lens
            checks once that the ranks agree (instruments, settings, schedule, merge, parameters).

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
        timeout: float | None = DEFAULT_TIMEOUT_S,
        groups: Any = None,
    ):
        optimizer, wrapped_scaler = unwrap_optimizer(optimizer)  # Accelerate: the torch optimizer inside
        model, self._pipe = resolve_pipeline(model)  # Lens(schedule): a pipeline stage (gradlens/lens/pipeline.py)
        model, optimizer, zero = resolve_deepspeed(model, optimizer)  # DeepSpeed: the engine's module, ..., a ZeroView
        # torch.compile(model) or model.compile(): tracked windows run the model eagerly
        compiled_wrapper = compiled_original(model) is not model or compiled_in_place(model)
        model, given = watched_model(model), model
        instruments = check_instruments(instruments)
        if grad_scaler is None:
            grad_scaler = wrapped_scaler
        groups = check_groups(groups)
        check_options(every, optimizer, keep_records, log_mode, chunk_elements, grad_scaler, undefined)
        extra_sinks = check_sinks(sinks)
        # a GradientAccumulateOptimizer reports skipped windows itself; else the scale tells
        self._amp = ScalerSkips(None if isinstance(optimizer, GradientAccumulateOptimizer) else grad_scaler)
        self.model = model
        self.instruments = instruments
        self.optimizer = optimizer
        self.every = every
        self.keep_records = keep_records
        self.records: list[Record] = []
        self._counter = WindowCounter()  # step (windows closed) and skipped_windows

        self._exclude = model_exclusions(model) + tuple(exclude)
        # FSDP2 (fully_shard): the Lens tracks the unsharded parameters (self._sharded, gradlens/distributed/fsdp.py;
        # DeepSpeed ZeRO: the ZeroView, gradlens/distributed/deepspeed.py; tensor parallelism: self._tp, tensor_parallel.py)
        params, self._sharded = tracked_at_build(model, self._exclude, instruments, zero)
        # what the instruments need, compiled once; the Meter measures each use for them and
        # builds the Tap (or, for instruments of the window gradient only, the ParamTap)
        with presenting(self._sharded):
            self._meter = Meter(model, params, Plan.compile(instruments, groups), chunk_elements=chunk_elements,
                                undefined=undefined, **meter_layout(self, model, params, instruments))
        self._tap = self._meter.tap
        view = self._sharded  # Instrument.attach (once): the optimizer, the tracked parameters (sharded: gathered)
        tracked = (lambda: self._tap.params) if view is None else (lambda: view.full_values(self._tap.params))
        for inst in instruments:
            inst.attach(tracked, optimizer)
        self._tap.run_eager = compiled_wrapper  # tracked forwards of torch.compile(model) run eagerly
        self._route = make_route(given, self._meter) if compiled_wrapper else None  # ... or with probes
        plan = self._meter.plan
        self._group, self._ranks = rank_merge(self._pipe, data_group(process_group, self._tp), merge, timeout,
                                              instruments, plan, groups)  # a pipeline: across its stages; TP: data ranks
        self._ddp_route = self._ranks.route  # under DDP: the global grad_sum from p.grad when exact

        # under torch.distributed: rank 0 writes; a sink that fails is reported and retried,
        # never raised here; a new segment of the log starts at the first record (a fresh Lens
        # starts a new run, a Lens loaded from a checkpoint replaces the records after it)
        self._sinks = _open_sinks(log, log_mode, tensorboard, is_writer(self._group) and tp_writer(self._tp))
        try:  # once, under torch.distributed: every rank has the same instruments and schedule
            self._ranks.check_agree(instruments, every, self.step, params, groups)
        except BaseException:
            self._sinks.close()  # the sinks this Lens opened (a JsonlSink's lock on the log)
            raise
        self._sinks.extend(extra_sinks)

        self._hooks = _optimizer_hooks(optimizer, self)  # its real updates close the windows
        self._readers = OptimizerGrads(instruments, self._sharded is not None)  # AccumulationCheck
        self._stated = StatedFactors()  # capture(multiplier=..., loss=...): never divided out twice
        self._hooks += self._readers.hooks(optimizer, lambda: self._readers.written(self._window))
        self._capturing: tuple | None = None  # (micro-step, undefined count) of the open capture
        self._pools: dict[str, dict] = {}  # buffers of large window sums, reused
        self._pending = PendingRecord()  # a record waiting for the next window (Alpha)
        self._compiled = CompileNotice(compiled_wrapper)  # torch.compile: warned once
        self._probes = ForwardProbes(model, self._compiled, self._ddp_route)  # tracked windows only
        #: the current tracked window (gradlens.core.window), None while untracked: dropping a
        #: window (skipped, discarded, a failed capture) is replacing this one object
        self._window: Window | None = None
        self._closed = False
        self._curvature = CurvatureGraph(instruments)  # HessMaxEV, ...: the gradients with their graphs
        model.__dict__["_gradlens_lens"] = weakref.ref(self)  # plain attribute, not a submodule
        self._open_window()

    #: windows closed so far (the schedule's position) and windows ended without an update
    step = counter_property("updates", "index of the current window (windows closed so far)")
    skipped_windows = counter_property("skipped", "windows ended without an update (no record)")
    #: ``Lens(merge=..., timeout=..., grad_scaler=...)`` as the Lens applies them
    merge = _setting("_ranks", "mode", "Lens(merge=...): 'sync' or 'deferred'")
    timeout = _setting("_ranks", "timeout", "Lens(timeout=...): seconds each collective waits")
    grad_scaler = _setting("_amp", "scaler", "the GradScaler whose skipped steps drop windows")

    # ------------------------------------------------------------------ schedule and windows
    def is_tracked(self, step: int | None = None) -> bool:
        """Whether window ``step`` (default: the current one) is tracked."""
        step = self.step if step is None else step
        return bool(self.every(step)) if callable(self.every) else step % self.every == 0

    def _open_window(self) -> None:
        """Start the current window afresh: a new :class:`~gradlens.core.window.Window` when it
        is tracked (the one before, closed or dropped, goes with its stacked uses and empty
        micro-steps), None when not."""
        self._window = None
        self._partial = False  # the window began before this Lens saw it (GradientAccumulateOptimizer)
        self._stated.pending = []
        self._curvature.release(self._meter)  # the previous window's graphs go
        self._ranks.drop_issued()  # issued for a window dropped since: every rank waits
        if self.is_tracked():
            coverage = self._refresh_params()
            self._probes.arm(self)  # the window's first forward refreshes them again
            for i in self.instruments:  # parameter -> group (Lens(groups=...)), before the states
                i.bind_groups(self._meter.group_of)
            window = Window.open(self._pools, {id(i): i.start_window() for i in self.instruments}, coverage)
            self._curvature.open(self._tap.params, self._group, self.model, self._meter)
            self._use_window(window)
            if not open_tracked(self):  # the compiled route, or the Tap
                with presenting(self._sharded):
                    self._meter.install()
            self._probes.install()
            if self._ddp_route is not None:
                self._ddp_route.reset()
            self._amp.window_opened()
        else:
            self._meter.remove()
            self._probes.remove(self._route)  # and the params probe, the compiled route
        self._ranks.done = False

    def _use_window(self, window: Window) -> None:
        """Make ``window`` (just opened, or loaded from a checkpoint into a window just opened)
        the current one: the curvature instruments' states get the window's graph, GradHist2d
        under FSDP2 the gathered parameter values."""
        self._window = window
        self._curvature.bind(window.states)
        if self._sharded is not None:  # GradHist2d's parameter axis: the gathered values
            self._sharded.bin_values(self.instruments, window.states, self._tap.params)

    def _merge_ranks(self, defer_off: bool = False) -> None:
        """Under torch.distributed: replace this rank's window statistics and instrument states
        by those of all ranks (one all_reduce, plus one all_gather when per-sample vectors are
        kept; see :mod:`gradlens.distributed.merge`). Once per tracked window; nothing otherwise."""
        window = self._window
        if window is not None:  # small uses measured at the window's end
            self._meter.settle(window)
            window = self._window = tp_fold(self._tp, window, self._meter, self._ranks, self.instruments)  # (TP: once)
        ranks = self._ranks
        if not ranks.due(window):
            return
        sites = [window.sites[n] for n in sorted(window.sites)]
        ctx = ranks.context(dict(self._tap.params), sites, self._meter.plan.needs, self._ddp_route, self.step,
                            tuple(self._meter.groups))
        # merge="deferred" (not defer_off): the previous window's collective came first, it finishes first
        self._window = ranks.merge(window, self.instruments, ctx, defer=not defer_off, first=self._finish_inflight)

    # ------------------------------------------------------------------ coverage
    #: ``Lens(chunk_elements=..., undefined=...)``, as the Meter applies them
    chunk_elements = _setting("_meter", "chunk_elements", "Lens(chunk_elements=...)")
    undefined = _setting("_meter.undefined", "mode", "Lens(undefined=...): 'error', 'exclude' or 'contribution'")

    @property
    def tracked(self) -> list[str]:
        """Qualified names of the tracked parameters (as in ``model.named_parameters()``)."""
        return list(self._tap.params)

    @property
    def groups(self) -> dict[str, tuple[str, ...]]:
        """``Lens(groups=...)``: group name -> its tracked parameters, in order (``{}`` without)."""
        return dict(self._meter.groups)

    @property
    def coverage(self) -> float:
        """Fraction of the model's trainable elements whose per-sample gradients are tracked."""
        return tracked_fraction(self._tap.params, self.model)

    def _refresh_params(self) -> float:
        """Follow parameters frozen, unfrozen or added since the last tracked window; returns
        the coverage of the tracked ones (the window's, :attr:`Window.coverage <gradlens.core.window.Window.coverage>`)."""
        params, total = trainable_split(self.model, self._exclude)  # names checked at build
        if self._sharded is not None:
            params = self._sharded.unsharded(params)
        with presenting(self._sharded):
            self._meter.follow(params)
        return sum(full_numel(p) for p in self._tap.params.values()) / max(total, 1)

    def _on_pre_step(self, optimizer, args, kwargs):
        if self._partial:
            self._window = None  # began before this Lens saw it: no record
        if self._window is None:
            return None
        return after_closure(args, kwargs, self._before_update)

    def _before_update(self) -> None:
        self._stated.verify_or_raise(self._open_window)  # on an accelerator: read now
        if self._window is not None:
            self._merge_ranks()
            self._readers.before_update(self._window, self.grad_scaler)
            states = self._window.states
            if self._sharded is not None:  # Alpha's theta_t: the gathered values
                self._sharded.present_values(self.instruments, states, self._tap.params)
            for i in self.instruments:
                i.before_update(states[id(i)])

    def _on_step(self, optimizer, args, kwargs) -> None:
        if self._window is not None:
            states = self._window.states
            if self._sharded is not None:  # Alpha's theta_{t+1}: the gathered values
                self._sharded.present_values(self.instruments, states, self._tap.params)
            for i in self.instruments:
                i.after_update(states[id(i)])
        self._close_window()

    def flush(self) -> Record | None:
        """Close the current window as if the optimizer had updated: emit its record (if it is
        tracked and captured anything) and start the next window. Returns the record."""
        self._check_open()
        return self._close_window(sync=True)

    def _close_window(self, sync: bool = False) -> Record | None:
        self._stated.verify_or_raise(self._open_window)  # on an accelerator: read now
        if self._partial:
            self._window = None
        if sync:
            self._finish_inflight()
        self._merge_ranks(defer_off=sync)
        record = None  # merge="deferred": the record comes with the next window
        if not self._ranks.hold(self.step, self._window):
            record = self._emit(self.step, self._window)
        self._counter.close(updated=True)
        self._open_window()
        return record

    def _finish_inflight(self) -> Record | None:
        """merge="deferred": wait for the previous window's collective and emit its record."""
        done = self._ranks.finish_inflight()
        return None if done is None else self._emit(*done)

    def _emit(self, step: int, window: Window | None) -> Record | None:
        """The record of a closed window (merged across ranks when distributed), to
        :attr:`records` and the sinks; None if it was not tracked or captured nothing."""
        record = None
        if self._sinks.first_window is None:  # where this Lens's log segment starts
            self._sinks.first_window = step
        captured = window is not None and bool(window.micro_steps)
        reason = None if captured else f"window {step} (the next one) was not tracked or captured nothing"
        self._pending.settle(self.instruments, reason, window.states if captured else {}, self._sinks.write)
        if captured:
            record = window_record(step, window, self.instruments, self._meter.groups)
            if self._meter.undefined_params:  # Lens(undefined="exclude") left these out: why
                record.meta["undefined"] = dict(self._meter.undefined_params)
            route_meta(self._route, record.meta)  # torch.compile: the route the window took
            warn_nonfinite(record, self.optimizer, self.grad_scaler, self._tap.params.values())
            deferring = end_window(window.states, self.instruments)
            keep_record(self.records, record, self.keep_records)
            if deferring:  # e.g. Alpha: completed by the next window, then written to the sinks
                self._pending.held = (record, deferring)
            else:
                self._sinks.write(record)  # failures warn; the window still closes
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
            self._counter.close(updated=False)
            self._open_window()

    @property
    def create_graph(self) -> bool:
        """True on tracked windows of a Lens with a curvature instrument (HessMaxEV, HessTrace,
        TICDiag, TICTrace): pass it to the micro-steps' ``loss.backward(create_graph=lens.create_graph)``."""
        return self._window is not None and bool(self._curvature.instruments)

    _graph = property(lambda self: self._curvature.graph)  # the window's WindowGraph, or None

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
        called inside the model's forward (``model(x, labels=y).loss``): a plain ``capture()``,
        which measures what multiplied that loss on its way to ``backward`` (a ``1/K``, a
        GradScaler's scale) and divides it out. For a loss computed outside the model pass
        ``reduction="mean"|"sum"`` (the batch size is read from the model's input) and ``loss=``.
        Units (docs/design.md): with ``L`` the micro-step's objective split by sample, g_n = B * dL_n
        for a mean objective (a token-mean language-model loss, ignored targets included) and
        dL_n for a sum; ``record.meta["units"]`` says which. ``losses``: optional per-sample
        losses ``[B]`` of this micro-step. ``loss=`` and ``multiplier=`` have one meaning each
        (:mod:`gradlens.lens.stated`):

        Args:
            loss: the 0-d loss tensor as computed; whatever multiplies it between it and
                ``backward`` (``(loss / K).backward()``, ``scaler.scale(loss).backward()``) is
                measured in backward (no host sync) and divided out. Backward must pass through it.
            multiplier: a factor gradlens cannot see (positive float, or 0-d tensor). With
                ``loss=``: one *inside* ``loss`` (``loss`` is ``multiplier`` times the micro-step's
                mean objective, a declared window objective: the Hugging Face Trainer's ``B_k / N``;
                the objective, and ``record["loss"]``, is ``loss / multiplier``). Without ``loss=``:
                the factor between the micro-step's objective and what is backpropagated. A factor
                that ``loss=`` lets gradlens measure, stated again (``capture(reduction="mean",
                multiplier=1/K, loss=raw)`` around ``(raw / K).backward()``), is refused with a
                ``ValueError`` (the window is dropped): it would be divided out twice.
        """
        self._check_open()
        if self._pipe is not None and not self._pipe.inside:  # around schedule.step(): per micro-batch
            return (yield from pipeline_capture(self, self._pipe, reduction, losses, multiplier, loss))
        if loss is not None and reduction is None:
            raise ValueError("lens.capture(loss=...) needs the loss's reduction: capture(reduction='mean', loss=loss)")
        multiplier = check_multiplier(reduction, multiplier, loss)
        calls = take_loss_calls()
        if self._window is None:  # untracked window: nothing to do, nothing to pay
            yield
            return
        meter = self._meter
        if meter.micro is not None:
            raise RuntimeError("lens.capture() is already active; captures cannot be nested")
        if self._window.micro_steps and self._amp.drop_skipped(self.step, self._counter):
            self._open_window()  # the GradScaler skipped the step that should have closed it
        if not self._window.micro_steps and not self._partial:
            self._partial = began_unseen(self.optimizer, self.step)  # not recorded: warned
        self._compiled.warn_once(self._tap, meter.plan.light, self._route)
        undefined = len(meter.undefined_params)
        try:
            micro = meter.begin(reduction, loss, multiplier, losses, calls, self._window)
            self._readers.before_backward(self._window, micro)
        finally:
            if len(meter.undefined_params) != undefined:  # undefined="exclude" left some out
                self._window.coverage = self.coverage
        if self._ddp_route is not None:
            self._ddp_route.start_micro(self._tap.params)
        self._capturing = (micro, undefined)
        try:
            yield
        except BaseException:
            if self._capturing is not None and self._capturing[0] is micro:  # not ended early
                self._capturing = None
                self._drop_capture(micro, undefined, stacklevel=4)
            raise
        self._end_capture(micro, undefined)

    def _drop_capture(self, micro, undefined: int, stacklevel: int) -> None:
        """An exception inside the capture: the window's sums are accumulated in place, so a
        micro-step that failed half way invalidates the window. Drop it (no record)."""
        try:
            if micro.seen:
                warnings.warn(
                    f"an exception inside lens.capture() interrupted window {self.step}; its "
                    "statistics are dropped",
                    RuntimeWarning,
                    stacklevel=stacklevel,
                )
                self._open_window()
        finally:
            self._meter.end(micro)
            self._readers.abort()
            if len(self._meter.undefined_params) != undefined:  # excluded during backward
                self._window.coverage = self.coverage

    def _end_capture(self, micro, undefined: int) -> None:
        """The capture's end: the micro-step folds into the window. Also called by DeepSpeed's
        step inside the capture (``accelerator.backward`` steps the engine): the with-block's
        exit then has nothing left to do."""
        if self._capturing is None or self._capturing[0] is not micro:
            return
        self._capturing = None
        meter = self._meter
        try:  # (the compiled route: the probes' gradients first; the eager one judged once)
            compiled, judged = finish_micro(self._route, meter, micro)
        except BaseException:
            self._drop_capture(micro, undefined, stacklevel=5)
            raise
        meter.end(micro)
        self._readers.abort()
        if len(meter.undefined_params) != undefined:  # excluded during backward
            self._window.coverage = self.coverage
        if micro.empty:
            self._window.empty_micro_steps += 1
            return
        err, drop = capture_error(micro)
        if err is None and self._stated.check(micro, self.grad_scaler):
            err, drop = self._stated.error(), True  # its sums divided a factor out twice
        if err is not None:
            if drop:  # the window's sums used a wrong or unknown scale: drop them
                self._open_window()
            raise err
        if self._graph is not None:  # curvature: this micro-step's gradient with its graph
            self._curvature.end_micro(micro, drop=self._open_window)
        self._window = meter.fold(micro, self._window)
        self._readers.after_backward(self._window, micro, self.grad_scaler)
        if isinstance(self.optimizer, GradientAccumulateOptimizer):
            self.optimizer.note_micro_batch(micro.batch_size)  # its step(num_samples=...) must agree
        if self._ddp_route is not None:
            self._ddp_route.end_micro(self._tap.params, micro.scale())
        end_micro(self, micro, compiled, judged)

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume this Lens in a fresh process, exactly.

        Holds the window index ``step`` (the schedule's position), ``skipped_windows``, the
        instruments (type, record key, order) with each one's state between windows
        (:meth:`~gradlens.instruments.Instrument.state_dict`: adaptive histogram ranges,
        sampling streams, Alpha's last update direction, ...), the tracked parameters (names,
        shapes, dtypes), the pending record (Alpha's record waits for the next window) and, when
        saved mid-window, the partial window itself (the sums, per-sample norms, histogram counts
        and factors of the micro-steps captured so far). Save it together with the model's and
        the optimizer's state dicts (a :class:`~gradlens.GradientAccumulateOptimizer` saves its
        own partial window); a new Lens on the loaded model then gives the same records as the
        run that was not interrupted.

        Format (:mod:`gradlens.lens.state`, version 3): plain data that
        ``torch.load(weights_only=True)`` reads, the partial window written field by field and
        copied; :meth:`load_state_dict` never unpickles. A custom instrument's window state of
        its own class is refused mid-window.
        """
        self._finish_inflight()  # merge="deferred": the window in flight gets its record first
        window = self._window
        if self._partial:  # a window begun before this Lens saw it is not kept
            self._window = None
        elif window is not None:  # the partial window complete with its small uses
            self._meter.settle(window)
        try:
            return lens_state_dict(self)
        finally:
            self._window = window

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (of a Lens with the same instruments on the same
        model). The records, the log lines and the pending record continue where the saved
        Lens stopped. Everything is checked before anything changes (:mod:`gradlens.lens.state`).

        The state is data, never code: an entry that holds anything but plain data and
        gradlens' own state classes (an altered or foreign checkpoint) is refused, and nothing
        in it runs.

        Raises:
            gradlens.lens.state.StateDictError (a ValueError and a TypeError): not a gradlens Lens
                state dict, another version (the message names the way out), other instruments
                or settings, other tracked parameters, a partial window this Lens's schedule does
                not track, or an entry that holds what a Lens state does not.
        """
        self._check_open()
        load_lens_state_dict(self, state_dict)

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
            self._pending.settle(self.instruments, "the Lens was closed before the next window closed", {},
                                 self._sinks.write)
        self._pending.held = None
        self._closed = True
        if getattr(self.model, "_gradlens_lens", None) is not None and self.model._gradlens_lens() is self:
            del self.model.__dict__["_gradlens_lens"]
        self._meter.remove()
        self._probes.remove(self._route)  # and the params probe, the compiled route
        self._curvature.release(self._meter)
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._sinks.close()  # a sink that fails to close warns; the others still close

    def __enter__(self) -> "Lens":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Lens({type(self.model).__name__}, {self.instruments!r}, step={self.step}, "
            f"tracked={len(self._tap.params)} parameters, coverage={100 * self.coverage:.1f}%)"
        )



# ---------------------------------------------------------------------- optimizer hooks
def _optimizer_hooks(optimizer: torch.optim.Optimizer | None, lens: Lens) -> list:
    """The hooks through which ``optimizer`` (None: none) drives the windows of ``lens``: its
    step pre-hook (the update is next), post-hook (closes the window) and, on a
    :class:`~gradlens.GradientAccumulateOptimizer`, the end of every window (skipped ones too)."""
    if optimizer is None:
        return []
    if isinstance(lens._sharded, ZeroView):  # DeepSpeed's step writes the update into the model
        return lens._sharded.step_hooks(lambda: _before_deepspeed_step(lens), lambda u: _after_deepspeed_step(lens, u))
    hooks = [optimizer.register_step_pre_hook(lens._on_pre_step), optimizer.register_step_post_hook(lens._on_step)]
    if isinstance(optimizer, GradientAccumulateOptimizer):
        hooks.append(optimizer.register_window_end_hook(lens._on_window_end))
    return hooks


def _before_deepspeed_step(lens: Lens) -> None:
    """DeepSpeed's optimizer is about to update (:mod:`gradlens.distributed.deepspeed`): a capture
    still open ends first (the engine stepped inside its backward call), then the window is
    complete (the ranks merge, theta_t is read)."""
    if lens._capturing is not None:
        lens._end_capture(*lens._capturing)
    lens._before_update()


def _after_deepspeed_step(lens: Lens, updated: bool) -> None:
    """DeepSpeed's optimizer wrote theta_{t+1} into the model (``updated``; the window closes)
    or skipped the update (fp16 inf/nan; the window is dropped without a record)."""
    if updated:
        lens._on_step(None, (), {})
    else:
        lens._on_window_end(None, False)


# ---------------------------------------------------------------------- sinks
def _open_sinks(log, log_mode: str, tensorboard: Any, writer: bool) -> SinkSet:
    """The sinks this Lens opens, in order: the JSONL log, TensorBoard (both on the writing rank
    only; ``Lens(sinks=...)`` are added after them)."""
    sinks = SinkSet()
    if log is not None and writer:
        sinks.append(log if isinstance(log, JsonlSink) else JsonlSink(
            log, mode="overwrite" if log_mode == "overwrite" else "append"
        ))
    if tensorboard is not None and writer:
        from gradlens.output.sinks import TensorBoardSink

        sinks.append(TensorBoardSink(tensorboard))
    return sinks
