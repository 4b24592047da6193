"""The Lens: watches a model (and optionally its optimizer), opens and closes windows, runs the
instruments on every captured micro-step, and keeps and streams one record per tracked window.

A window is one real optimizer update (DESIGN.md). With an ``optimizer``, the window closes in
the optimizer's step post-hook (with :class:`~gradlens.GradientAccumulateOptimizer` that hook
fires on real updates only); without one, call :meth:`Lens.flush` at the end of each window.
"""

from __future__ import annotations

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
            :func:`gradlens.load_log`).
        tensorboard: a ``SummaryWriter`` or a log directory for TensorBoard scalars/histograms.
        keep_records: keep records in :attr:`records` (set False for long runs with ``log``).
        chunk_elements: upper bound on the elements of one materialised slice of per-sample
            gradients ``[b, *param]`` (histograms); memory stays at one such slice per layer.
        sinks: more places for the records (after ``log`` and ``tensorboard``): any objects
            with ``write(record)`` and ``close()``. ``write`` is called once per record, in the
            order records become final (a record waiting for the next window, e.g. for
            ``Alpha``, is written when that window closes), ``close`` once by :meth:`close`.
            E.g. :class:`gradlens.integrations.wandb.WandbSink`.

    Attributes:
        records: the records so far (if ``keep_records``).
        step: index of the current window (number of windows closed so far).
        skipped_windows: windows a :class:`~gradlens.GradientAccumulateOptimizer` ended without
            an update (their statistics are dropped; no record).
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
        keep_records: bool = True,
        chunk_elements: int = 1 << 20,
        sinks: Iterable[Any] = (),
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"Lens(model=...) takes an nn.Module, got {type(model).__name__}")
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
        if not isinstance(chunk_elements, int) or chunk_elements < 1:
            raise ValueError(f"chunk_elements must be a positive int, got {chunk_elements!r}")
        extra_sinks = _check_sinks(sinks)

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

            self._sinks.append(JsonlSink(log))
        if tensorboard is not None:
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
        self._micro: _MicroStep | None = None
        self._pending: tuple[Record, dict[int, Any]] | None = None
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
        else:
            self._window = None
            self._states = {}
            self._tap.remove()

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
            deferring = {id(i): self._states[id(i)] for i in self.instruments if i.defers(self._states[id(i)])}
            for i in self.instruments:
                i.end_window(self._states[id(i)])
            if self.keep_records:
                self.records.append(record)
            if deferring:  # e.g. Alpha: completed by the next window, then written to the sinks
                self._pending = (record, deferring)
            else:
                for sink in self._sinks:
                    sink.write(record)
        self.step += 1
        self._open_window()
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
        passed through :func:`gradlens.extend`; pass ``reduction="mean"|"sum"`` to use a
        functional loss instead (the batch size is then read from the model's layers).
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
        probe = _check_multiplier(reduction, multiplier, loss)
        call = last_loss_call()
        if self._window is None:  # untracked window: nothing to do, nothing to pay
            yield
            return
        if self._micro is not None:
            raise RuntimeError("lens.capture() is already active; captures cannot be nested")
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
        elif probe is not None:
            micro.loss_call = probe
            probe.watch()
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
        if probe is not None and probe.missed():
            self._open_window()  # the window's sums used an unknown scale: drop them
            raise RuntimeError(
                "lens.capture(loss=...): backward did not pass through the given loss tensor, "
                "so what multiplied it is unknown; pass the tensor that is backpropagated (or "
                "scaled and then backpropagated), or state multiplier= instead"
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

    def _on_sentinel(self, name: str, module: nn.Module) -> None:
        micro = self._micro
        if micro is not None and module.training and micro.tainted_by is None:
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

    # ------------------------------------------------------------------ lifecycle
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Lens was closed; create a new one")

    def close(self) -> None:
        """Remove every hook this Lens added and close its sinks (idempotent). Records stay."""
        if self._closed:
            return
        self._settle_pending("the Lens was closed before the next window closed")
        self._closed = True
        self._tap.remove()
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



# ---------------------------------------------------------------------- sinks and multipliers
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


class _Multiplier:
    """What multiplied a functional loss in backward: a known ``factor`` times what a hook on
    ``loss`` sees (duck-types :class:`~gradlens.capture.LossCall`'s ``multiplier``)."""

    def __init__(self, factor: float | Tensor | None, loss: Tensor | None):
        self.factor = factor
        self.loss = loss
        self.measured: Tensor | None = None

    def watch(self) -> None:
        if self.loss is not None:
            self.loss.register_hook(self._set)

    def _set(self, grad: Tensor) -> None:
        self.measured = grad.detach()

    def missed(self) -> bool:
        return self.loss is not None and self.measured is None

    @property
    def multiplier(self) -> float | Tensor | None:
        if self.measured is None:
            return self.factor
        return self.measured if self.factor is None else self.measured * self.factor


def _check_multiplier(reduction, multiplier, loss) -> _Multiplier | None:
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
    return _Multiplier(multiplier, loss)
