"""The Lens: watches a model (and optionally its optimizer), opens and closes windows, runs the
instruments on every captured micro-step, and keeps and streams one record per tracked window.

A window is one real optimizer update (DESIGN.md). With an ``optimizer``, the window closes in
the optimizer's step post-hook (with :class:`~gradlens.GradientAccumulateOptimizer` that hook
fires on real updates only); without one, call :meth:`Lens.flush` at the end of each window.
"""

from __future__ import annotations

import math
import os
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import Tensor, nn

from gradlens.capture import (
    Tap,
    WatchedModule,
    is_extended,
    last_loss_call,
    model_exclusions,
    watched_modules,
)
from gradlens.instruments.base import Accumulators, Instrument, WindowStats
from gradlens.kernels import add_into
from gradlens.records import Record

__all__ = ["Lens"]

_LENS_STATE_VERSION = 1


@dataclass
class _MicroStep:
    reduction: str
    batch_size: int | None
    loss_value: Tensor | None
    stats: WindowStats
    states: dict[int, Any]
    seen: set[str] = field(default_factory=set)
    batch_l2: Tensor | None = None
    tainted_by: str | None = None
    losses: Tensor | None = None
    loss_call: Any = None  # the LossCall of this micro-step (its multiplier), if any
    _scale: Any = None

    def scale(self) -> float | Tensor:
        """Output gradients -> per-sample units: B / c under a mean loss, 1 / c under a sum,
        c being what multiplied the loss in backward (1, a GradScaler scale, 1/K, ...)."""
        if self._scale is None:
            base = float(self.batch_size) if self.reduction == "mean" else 1.0
            c = getattr(self.loss_call, "multiplier", None)
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
            gradients ``[b, *param]`` (histograms); memory stays at one such slice per layer.

    Attributes:
        records: the records so far (if ``keep_records``).
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
        chunk_elements: int = 1 << 20,
        log_mode: str = "resume",
        grad_scaler: Any = None,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"Lens(model=...) takes an nn.Module, got {type(model).__name__}")
        model = getattr(model, "_orig_mod", model)  # torch.compile(model): watch the module itself
        if not is_extended(model):
            raise RuntimeError(
                f"the model ({type(model).__name__}) was not extended; call "
                "model = gradlens.extend(model) before creating the Lens"
            )
        instruments = list(instruments)
        for inst in instruments:
            if not isinstance(inst, Instrument):
                raise TypeError(
                    f"instruments must be gradlens.instruments objects, got {inst!r}; "
                    "did you pass the class instead of an instance, e.g. BatchL2 instead of BatchL2()?"
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

        exclude = model_exclusions(model) + tuple(exclude)
        self.watched: list[WatchedModule] = watched_modules(model, exclude)
        if not self.watched:
            raise ValueError("the model has no trainable parameters left to track after exclusions")
        self._param_of = {
            q: getattr(w.module, attr) for w in self.watched for attr, q in w.params.items()
        }
        self._needs = frozenset().union(*(i.needs for i in instruments)) if instruments else frozenset()
        self._per_sample_insts = [i for i in instruments if "per_sample" in i.needs]
        self._layer_insts = [i for i in instruments if "layer" in i.needs]
        self._micro_insts = self._per_sample_insts + [
            i for i in self._layer_insts if i not in self._per_sample_insts
        ]
        sentinels = [
            (n, m)
            for n, m in model.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)
        ]
        self._tap = Tap(
            self.watched,
            self._on_grad,
            sentinels,
            self._on_sentinel,
            on_weight_grad=self._on_weight_grad if "grad_sum" in self._needs else None,
        )

        self._sinks: list[Any] = []
        if log is not None:
            from gradlens.sinks import JsonlSink

            sink = log if isinstance(log, JsonlSink) else JsonlSink(
                log, mode="overwrite" if log_mode == "overwrite" else "append"
            )
            self._sinks.append(sink)
            if log_mode == "resume" and sink.next_step is not None:
                self.step = sink.next_step
        if tensorboard is not None:
            from gradlens.sinks import TensorBoardSink

            self._sinks.append(TensorBoardSink(tensorboard))

        self._hooks = []
        if optimizer is not None:
            self._hooks.append(optimizer.register_step_pre_hook(self._on_pre_step))
            self._hooks.append(optimizer.register_step_post_hook(self._on_step))
            if hasattr(optimizer, "register_window_end_hook"):  # GradientAccumulateOptimizer
                self._hooks.append(optimizer.register_window_end_hook(self._on_window_end))
        self._pools: dict[str, dict] = {}  # buffers of large window sums, reused
        self._micro: _MicroStep | None = None
        self._pending: tuple[Record, dict[int, Any]] | None = None
        self._compile_probe = None  # a forward pre-hook of tracked windows: is the model compiled?
        self._compiled_seen = False
        self._compile_warned = False
        self._window: WindowStats | None = None
        self._states: dict[int, Any] = {}
        self._closed = False
        self._open_window()

    # ------------------------------------------------------------------ schedule and windows
    def is_tracked(self, step: int | None = None) -> bool:
        """Whether window ``step`` (default: the current one) is tracked."""
        step = self.step if step is None else step
        return bool(self.every(step)) if callable(self.every) else step % self.every == 0

    def _open_window(self) -> None:
        if self.is_tracked():
            self._window = WindowStats(
                sum_grad_squared=Accumulators(self._pools.setdefault("sum_grad_squared", {})),
                grad_sum=Accumulators(self._pools.setdefault("grad_sum", {})),
            )
            self._states = {id(i): i.start_window() for i in self.instruments}
            self._tap.install()
            if self._compile_probe is None:
                self._compile_probe = self.model.register_forward_pre_hook(_compile_probe(self))
            if self.grad_scaler is not None:
                self._scale_at_open = float(self.grad_scaler.get_scale())
        else:
            self._window = None
            self._states = {}
            self._tap.remove()
            self._remove_compile_probe()

    def _on_pre_step(self, optimizer, args, kwargs) -> None:
        if self._window is not None:
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
        return self._close_window()

    def _close_window(self) -> Record | None:
        record = None
        window = self._window
        captured = window is not None and bool(window.micro_steps)
        self._settle_pending(
            None if captured else f"window {self.step} (the next one) was not tracked or captured nothing"
        )
        if captured:
            values = {i.key: i.finalize(window, self._states[id(i)]) for i in self.instruments}
            values["loss"] = window.window_loss()
            record = Record(self.step, window.num_samples, window.micro_steps, values)
            for i in self.instruments:
                record.meta.update(i.meta(self._states[id(i)]))
            self._warn_nonfinite(record)
            deferring = {id(i): self._states[id(i)] for i in self.instruments if i.defers(self._states[id(i)])}
            for i in self.instruments:
                i.end_window(self._states[id(i)])
            if self.keep_records is True or self.keep_records > 0:
                self.records.append(record)
                if self.keep_records is not True and len(self.records) > self.keep_records:
                    del self.records[: len(self.records) - self.keep_records]
            if deferring:  # e.g. Alpha: completed by the next window, then written to the sinks
                self._pending = (record, deferring)
            else:
                for sink in self._sinks:
                    sink.write(record)
        self.step += 1
        self._open_window()
        return record

    def _on_window_end(self, optimizer, updated: bool) -> None:
        """A window the optimizer ended without an update (GradScaler inf/nan, ``reset()``): its
        statistics must not leak into the next window, and there is no record of it (the
        parameters did not move; the update index stays the same)."""
        if not updated:
            self.skipped_windows += 1
            self._open_window()

    def _remove_compile_probe(self) -> None:
        if self._compile_probe is not None:
            self._compile_probe.remove()
            self._compile_probe = None

    def _warn_compiled(self) -> None:
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

    def _settle_pending(self, reason: str | None) -> None:
        """Complete the pending record from the window now closing (``reason is None``) or
        mark what it lacks, then write it to the sinks."""
        if self._pending is None:
            return
        record, states = self._pending
        self._pending = None
        for i in self.instruments:
            if id(i) in states:
                i.settle(record, states[id(i)], None if reason else self._states[id(i)], reason)
        for sink in self._sinks:
            sink.write(record)

    # ------------------------------------------------------------------ capture
    @contextmanager
    def capture(self, reduction: str | None = None, losses: Tensor | None = None) -> Iterator[None]:
        """Context manager around one micro-step's ``loss.backward()``.

        The loss reduction and batch size come from the last forward pass of a loss module
        passed through :func:`gradlens.extend`; pass ``reduction="mean"|"sum"`` to use a
        functional loss instead (the batch size is then read from the model's layers).
        ``losses``: optional per-sample losses ``[B]`` of this micro-step.
        """
        self._check_open()
        call = last_loss_call()
        if self._window is None:  # untracked window: nothing to do, nothing to pay
            yield
            return
        if self._micro is not None:
            raise RuntimeError("lens.capture() is already active; captures cannot be nested")
        self._drop_window_skipped_by_scaler()
        self._warn_compiled()
        if reduction is None:
            if call is None:
                raise RuntimeError(
                    "no loss passed through gradlens.extend() ran since the last capture; "
                    "wrap the loss module (loss_fn = gradlens.extend(torch.nn.CrossEntropyLoss())) "
                    "or state the reduction: lens.capture(reduction='mean')"
                )
            ignored = call.ignored()
            if ignored:
                raise ValueError(
                    f"{call.module_name}(reduction='mean') saw {ignored} targets equal to "
                    "ignore_index, so it divides by fewer than the batch size and per-sample "
                    "gradients cannot be recovered; use reduction='sum'"
                )
            reduction, batch, value = call.reduction, call.batch_size, call.value
        else:
            if reduction not in ("mean", "sum"):
                raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
            batch, value = None, None
        if self._window.micro_steps and self._window.reduction != reduction:
            raise ValueError(
                f"this micro-step's loss uses reduction={reduction!r} but the window's earlier "
                f"micro-steps used {self._window.reduction!r}; use one reduction per window"
            )
        micro = _MicroStep(
            reduction=reduction,
            batch_size=batch,
            loss_value=value,
            stats=WindowStats(reduction=reduction),
            states={id(i): i.start_window() for i in self._micro_insts},
            losses=losses,
        )
        if batch is not None:
            micro.loss_call = call
            call.watch_multiplier()
        self._micro = micro
        try:
            yield
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
        if not micro.seen:
            raise RuntimeError(
                "lens.capture() exited without a backward pass through the watched model; "
                "call loss.backward() inside the with-block"
            )
        self._fold(micro)

    def _fold(self, micro: _MicroStep) -> None:
        b = micro.batch_size
        s = micro.stats
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
        self._window = self._window.merge(s)
        for inst in self._micro_insts:
            key = id(inst)
            inst.micro_done(micro.states[key], b, micro.reduction, micro.losses)
            self._states[key] = inst.merge(self._states[key], micro.states[key])
        note = getattr(self.optimizer, "note_micro_batch", None)  # GradientAccumulateOptimizer
        if note is not None:
            note(b)  # its step(num_samples=...) must agree

    def _on_sentinel(self, name: str, module: nn.Module) -> None:
        micro = self._micro
        mixes = module.training or getattr(module, "running_mean", 0) is None  # batch statistics
        if micro is not None and mixes and micro.tainted_by is None:
            micro.tainted_by = name

    def _on_weight_grad(self, w: WatchedModule, grad: Tensor | None) -> None:
        """Autograd's dL/dW of a Linear call (see :func:`gradlens.capture._weight_grad_node`):
        sum_n g_n of the weight is that times the per-sample scale; no extra matmul."""
        micro = self._micro
        if micro is None or grad is None or self._window is None:
            return
        with torch.no_grad():
            scale = micro.scale()
            acc, key = self._window.grad_sum, w.params["weight"]
            if key in acc:
                if isinstance(scale, Tensor):
                    acc[key].addcmul_(grad, scale)
                else:
                    acc[key].add_(grad, alpha=scale)
                return
            dtype = grad.dtype if grad.dtype in (torch.float32, torch.float64) else torch.float32
            out = acc.buffer(key, tuple(grad.shape), grad.to(dtype) if dtype != grad.dtype else grad)
            acc[key] = torch.mul(grad, scale, out=out)

    def _on_grad(self, w: WatchedModule, a: Tensor, g: Tensor, weight_via_node: bool = False) -> None:
        micro = self._micro
        if micro is None:
            raise RuntimeError(
                f"backward reached {w.name or 'the model'!r} outside lens.capture() during a "
                "tracked window; wrap the backward: with lens.capture(): loss.backward()"
            )
        if w.is_batchnorm and w.module.training:
            raise RuntimeError(
                f"BatchNorm {w.name!r} is in training mode: it mixes the samples of a batch, so "
                "per-sample gradients are undefined; call .eval() on it, or exclude it and every "
                f"layer before it (Lens(..., exclude=[{w.name!r}, ...]))"
            )
        if micro.tainted_by is not None:
            raise RuntimeError(
                f"per-sample gradients of {w.name!r} are undefined: it comes before BatchNorm "
                f"{micro.tainted_by!r}, which is in training mode and mixes samples; exclude "
                f"{w.name!r} (Lens(..., exclude=[...])) or put the BatchNorm in eval mode"
            )
        if w.name in micro.seen:
            raise RuntimeError(
                f"module {w.name!r} was used more than once in one forward pass; gradlens cannot "
                "split its gradient per use: use a separate module per call or exclude it"
            )
        micro.seen.add(w.name)
        batch = g.shape[0]
        if micro.batch_size is None:
            micro.batch_size = batch
        elif batch != micro.batch_size:
            raise RuntimeError(
                f"the loss saw a batch of {micro.batch_size} but {w.name!r} saw {batch}; gradlens "
                "needs the first dimension of the loss input to be the sample dimension"
            )
        with torch.no_grad():
            self._measure(w, a.detach(), g.detach(), micro, weight_via_node)

    def _measure(
        self, w: WatchedModule, a: Tensor, g: Tensor, micro: _MicroStep, weight_via_node: bool = False
    ) -> None:
        dtype = g.dtype if g.dtype in (torch.float32, torch.float64) else torch.float32
        delta = g.to(dtype) * micro.scale()
        if a.is_floating_point():
            a = a.to(dtype)
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
            skip = {("grad_sum", "weight")} if weight_via_node else ()
            l2 = kernel.reduce(module, a, delta, want, w.params, acc, skip)
            if l2:
                self._add_l2(micro, sum(l2))
        for inst in self._layer_insts:
            inst.update_layer(micro.states[id(inst)], w, a, delta)
        if not (per_sample or from_chunks):
            return
        # Rank-one weights (Linear): instruments with a factor fast path skip materialisation.
        done: set[tuple[int, str]] = set()
        for attr, (d2, a2) in kernel.outer_factors(module, a, delta).items():
            if attr in w.params:
                qname = w.params[attr]
                for inst in self._per_sample_insts:
                    if inst.update_outer(micro.states[id(inst)], qname, self._param_of[qname], d2, a2):
                        done.add((id(inst), attr))
        attrs = [
            attr
            for attr in w.params
            if from_chunks or any((id(i), attr) not in done for i in self._per_sample_insts)
        ]
        if not attrs:
            return
        numel = sum(getattr(module, attr).numel() for attr in attrs)
        step = max(1, self.chunk_elements // max(numel, 1))
        l2_parts = []
        for s in range(0, delta.shape[0], step):
            e = min(delta.shape[0], s + step)
            chunk = kernel.per_sample(module, a, delta, s, e, attrs=attrs)
            l2 = 0
            for attr in attrs:
                gb = chunk[attr]
                qname = w.params[attr]
                param = self._param_of[qname]
                for inst in self._per_sample_insts:
                    if (id(inst), attr) not in done:
                        inst.update(micro.states[id(inst)], qname, param, gb)
                if "batch_l2" in from_chunks:
                    l2 = l2 + gb.flatten(1).square().sum(1)
                if "sum_grad_squared" in from_chunks:
                    add_into(window.sum_grad_squared, qname, gb.square().sum(0))
                if "grad_sum" in from_chunks:
                    add_into(window.grad_sum, qname, gb.sum(0))
            if "batch_l2" in from_chunks:
                l2_parts.append(l2)
        if l2_parts:
            self._add_l2(micro, torch.cat(l2_parts))

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
        self._pending = None
        if payload["pending"] is not None:
            record, states = payload["pending"]
            self._pending = (record, {id(self.instruments[n]): st for n, st in states.items()})

    def _object_ids(self, by_pid: bool = False):
        """Objects a saved state refers to by name: tracked parameters, watched layers, the
        model's modules, the instruments and the buffer pools."""
        pairs = [(self._pools, ("pools", ""))]
        pairs += [(p, ("p", q)) for q, p in self._param_of.items()]
        pairs += [(w, ("w", w.name)) for w in self.watched]
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
        if write_pending:
            self._settle_pending("the Lens was closed before the next window closed")
        self._pending = None
        self._closed = True
        self._tap.remove()
        self._remove_compile_probe()
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
            f"tracked_params={len(self._param_of)})"
        )

