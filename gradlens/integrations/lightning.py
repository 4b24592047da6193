"""PyTorch Lightning: a ``Callback`` that attaches a :class:`~gradlens.Lens` to a LightningModule.

Imports Lightning (the ``lightning`` package, else ``pytorch_lightning``) only when this module
is imported. Example::

    from gradlens.integrations.lightning import LensCallback, report_losses
    from gradlens.instruments import BatchL2, GradNorm, GradHist1d, Alpha

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 4))
            self.loss_fn = gradlens.extend(nn.CrossEntropyLoss())   # or LensCallback(reduction="mean")
        def training_step(self, batch, batch_idx):
            x, y = batch
            out = self.net(x)
            report_losses(self, F.cross_entropy(out.detach(), y, reduction="none"))  # for Alpha only
            return self.loss_fn(out, y)

    lens_cb = LensCallback([BatchL2(), GradNorm(), GradHist1d(), Alpha()])
    L.Trainer(accumulate_grad_batches=3, callbacks=[lens_cb]).fit(Net(), loader)
    lens_cb.records[-1]["grad_norm"]
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterable, Sequence

try:
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - the older package name
    try:
        import pytorch_lightning as pl
    except ImportError as err:
        raise ImportError(
            "gradlens.integrations.lightning needs PyTorch Lightning: pip install lightning"
        ) from err

from torch import Tensor, nn

import gradlens
from gradlens import compat
from gradlens.capture.losses import pending_loss_calls
from gradlens.instruments.base import Instrument
from gradlens.lens.lens import Lens
from gradlens.core.records import Record, flatten
from gradlens.core.limits import CHUNK_ELEMENTS

__all__ = ["LensCallback", "report_losses"]


class LensCallback(pl.Callback):
    """Per-sample gradient statistics of a LightningModule, one record per optimizer step.

    Windows are Lightning's real optimizer steps: with ``Trainer(accumulate_grad_batches=K)``
    one window holds the K micro-batches of one update (the last window of an epoch may hold
    fewer), and K micro-steps report exactly what one batch of N = sum B_k would.

    The callback builds a :class:`~gradlens.Lens` when training starts (on the module, or on
    its submodule ``module``, passed through :func:`gradlens.extend`, and on the one optimizer
    of ``configure_optimizers``), opens ``lens.capture()`` in ``on_before_backward`` and closes
    it in ``on_after_backward``, so ``training_step`` stays as it is.

    **Loss scaling.** Lightning divides the loss by ``accumulate_grad_batches`` and, under
    ``precision="16-mixed"``, multiplies it by the GradScaler's scale before ``backward``; both
    are divided out, so per-sample gradients are the gradients of each sample's own loss
    (DESIGN.md units). With a loss module passed through :func:`gradlens.extend` (recommended)
    gradlens measures that multiplier in backward. With a functional loss
    (``F.cross_entropy(out, y)``) give ``reduction="mean"`` or ``"sum"``: the multiplier is
    then ``1 / accumulate_grad_batches`` (automatic optimization) times the GradScaler's scale.
    A step the GradScaler skips (inf/nan) leaves no record (``lens.skipped_windows``).

    **Alpha** needs each micro-step's per-sample losses: call :func:`report_losses` in
    ``training_step``. Every other instrument needs nothing more.

    **Where records go.** :attr:`records` (with ``keep_records``); the scalars of each record
    (:func:`gradlens.core.records.flatten`: ``gradlens/loss``, ``gradlens/grad_norm``,
    ...) to every logger of the Trainer with ``log_metrics(..., step=record.step)``, the
    TensorBoard logger getting scalars *and* histograms through
    :class:`gradlens.output.sinks.TensorBoardSink` on its ``SummaryWriter``; plus ``log``,
    ``tensorboard`` and ``sinks`` as for :class:`~gradlens.Lens`. A record that waits for the
    next window (``Alpha``) is logged when that window closes, at its own step.

    Args:
        instruments: instances from :mod:`gradlens.instruments`.
        module: attribute name of the submodule to watch (e.g. ``"net"``); ``None``: the whole
            LightningModule. A model it holds as an attribute, the loss computed inside it (a
            Hugging Face model, ``self.net(**batch).loss``), works with ``None`` too; only
            instruments of the window gradient alone (``GradNorm``, ``NoiseScaleTwoBatch``)
            need ``module=`` then, and the error says which name.
        reduction: ``None`` when the loss comes from a loss module passed through
            :func:`gradlens.extend`, else ``"mean"`` or ``"sum"`` (a functional loss).
        loggers: write scalars (and TensorBoard histograms) to the Trainer's loggers.
        every, exclude, log, tensorboard, sinks, keep_records, chunk_elements: as for
            :class:`~gradlens.Lens`.

    Attributes:
        lens: the :class:`~gradlens.Lens` (``None`` before training starts).
        records: the Lens' records (kept after training ends).
    """

    def __init__(
        self,
        instruments: Sequence[Instrument],
        *,
        module: str | None = None,
        reduction: str | None = None,
        loggers: bool = True,
        every: int | Callable[[int], bool] = 1,
        exclude: Iterable[str] = (),
        log: str | os.PathLike | None = None,
        tensorboard: Any = None,
        sinks: Iterable[Any] = (),
        keep_records: bool = True,
        chunk_elements: int = CHUNK_ELEMENTS,
    ) -> None:
        super().__init__()
        instruments = list(instruments)
        for inst in instruments:
            if not isinstance(inst, Instrument):
                raise TypeError(
                    f"LensCallback(instruments=...) takes gradlens.instruments objects, got {inst!r}; "
                    "did you pass the class instead of an instance, e.g. BatchL2 instead of BatchL2()?"
                )
        if reduction not in (None, "mean", "sum"):
            raise ValueError(
                f"LensCallback(reduction=...) must be None (a loss module passed through "
                f"gradlens.extend), 'mean' or 'sum', got {reduction!r}"
            )
        if module is not None and not isinstance(module, str):
            raise TypeError(
                f"LensCallback(module=...) is the attribute name of a submodule (e.g. 'net'), got "
                f"{type(module).__name__}"
            )
        self.instruments = instruments
        self.module = module
        self.reduction = reduction
        self.loggers = loggers
        self._lens_kwargs = dict(
            every=every, exclude=tuple(exclude), log=log, tensorboard=tensorboard,
            keep_records=keep_records, chunk_elements=chunk_elements,
        )
        self._sinks = list(sinks)
        self.lens: Lens | None = None
        self._records: list[Record] = []
        self._stack: contextlib.ExitStack | None = None
        self._losses: Tensor | None = None
        self._step_expected: int | None = None
        self._hint: str | None = None
        self._watched: str = ""

    # ------------------------------------------------------------------ records
    @property
    def records(self) -> list[Record]:
        return self.lens.records if self.lens is not None else self._records

    # ------------------------------------------------------------------ lifecycle
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.lens is not None:
            self.lens.close()
        target = pl_module
        if self.module is not None:
            target = getattr(pl_module, self.module, None)
            if not isinstance(target, nn.Module):
                raise ValueError(
                    f"LensCallback(module={self.module!r}): {type(pl_module).__name__} has no "
                    f"submodule {self.module!r}; give the attribute name of an nn.Module of it"
                )
        self._hint = _only_trainable_child(pl_module)
        self._watched = type(target).__name__ if self.module is None else repr(self.module)
        optimizers = list(trainer.optimizers)
        if len(optimizers) != 1:
            raise ValueError(
                f"LensCallback watches the windows of one optimizer, but configure_optimizers "
                f"returned {len(optimizers)}; use one optimizer (a window is one of its updates)"
            )
        sinks = list(self._sinks)
        if self.loggers:
            sinks.extend(_logger_sinks(trainer))
        kwargs = dict(self._lens_kwargs)
        scaler = getattr(trainer.precision_plugin, "scaler", None)  # 16-mixed: its steps and scale
        if scaler is not None and callable(getattr(scaler, "is_enabled", None)) and scaler.is_enabled():
            kwargs.setdefault("grad_scaler", scaler)
        self.lens = Lens(gradlens.extend(target), self.instruments, optimizer=optimizers[0], sinks=sinks, **kwargs)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            with contextlib.suppress(BaseException):
                stack.__exit__(type(exception), exception, exception.__traceback__)
        self._close()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close()

    def _close(self) -> None:
        if self.lens is not None:
            self._records = self.lens.records
            self.lens.close()

    # ------------------------------------------------------------------ micro-steps
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        lens = self.lens
        if lens is None or lens._closed:
            return
        if self._stack is not None:
            raise RuntimeError(
                "LensCallback: a backward started before the previous one finished "
                "(on_after_backward was not called); gradlens needs one backward per micro-step"
            )
        losses, self._losses = self._losses, None
        if self.reduction is None:
            if lens.is_tracked() and not pending_loss_calls():
                raise RuntimeError(
                    "LensCallback: no loss that gradlens can see ran in this training_step. If "
                    "the loss comes from inside a model held by the LightningModule (a Hugging "
                    "Face model's labels=), watch that model: "
                    f"LensCallback(..., module={self._module_hint()!r}); if it is a functional "
                    "loss in training_step, state its reduction: LensCallback(..., "
                    "reduction='mean'), or use loss_fn = gradlens.extend(nn.CrossEntropyLoss())"
                )
            capture = lens.capture(losses=losses)
        else:
            tap = getattr(lens, "_tap", None)
            if lens.is_tracked() and not pending_loss_calls() and tap is not None and tap.batch is None:
                # the watched model's forward never ran, so backward would find no batch size
                raise RuntimeError(
                    f"LensCallback: the watched {self._watched} ran no forward in this "
                    "training_step (Lightning calls training_step, not forward), so gradlens "
                    "cannot tell the micro-batch size; watch the model that training_step "
                    f"calls: LensCallback(..., module={self._module_hint()!r})"
                )
            capture = lens.capture(self.reduction, losses, multiplier=_multiplier(trainer, pl_module))
        stack = contextlib.ExitStack()
        stack.enter_context(capture)
        self._stack = stack

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            try:
                stack.close()  # the capture folds this micro-step into the window
            except RuntimeError as err:
                if "without a backward pass" not in str(err):
                    raise
                raise RuntimeError(
                    f"LensCallback: {err}. The backward did not reach the watched "
                    f"{self._watched}: watch the model that computes the loss, "
                    f"LensCallback(..., module={self._module_hint()!r})"
                ) from err

    def _module_hint(self) -> str:
        """The attribute name to suggest for ``module=``: the one child of the LightningModule
        that holds all its trainable parameters, else a placeholder to fill in."""
        return self._hint or "<attribute name of the model, e.g. 'net'>"

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        # Lightning is about to step: if the optimizer's own step hook does not fire (a
        # GradScaler skipped the update), the window must be dropped, not merged into the next.
        if self.lens is not None and not self.lens._closed:
            self._step_expected = self.lens.step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        expected, self._step_expected = self._step_expected, None
        lens = self.lens
        if expected is not None and lens is not None and not lens._closed and lens.step == expected:
            lens.discard_window()


def report_losses(pl_module: pl.LightningModule, losses: Tensor) -> None:
    """Hand this micro-step's per-sample losses ``[B]`` (e.g.
    ``F.cross_entropy(out.detach(), y, reduction="none")``) to the :class:`LensCallback` of the
    module's Trainer; call it in ``training_step``, before returning the loss. Needed by
    ``Alpha`` only (its f(0), f(1) observations).

    Raises:
        RuntimeError: the module is not attached to a Trainer with a :class:`LensCallback`.
        TypeError: ``losses`` is not a tensor.
    """
    if not isinstance(losses, Tensor):
        raise TypeError(f"report_losses(losses=...) takes a tensor [B], got {type(losses).__name__}")
    trainer = getattr(pl_module, "_trainer", None)
    callbacks = [c for c in getattr(trainer, "callbacks", []) if isinstance(c, LensCallback)]
    if not callbacks:
        raise RuntimeError(
            "report_losses(): the module's Trainer has no gradlens LensCallback; add one: "
            "Trainer(callbacks=[LensCallback([...])])"
        )
    for cb in callbacks:
        cb._losses = losses.detach()


def _only_trainable_child(pl_module: nn.Module) -> str | None:
    """Name of the direct child of ``pl_module`` that holds all of its trainable parameters
    (``self.net``), or None (parameters of its own, or spread over several children)."""
    trainable = {id(p) for p in pl_module.parameters() if p.requires_grad}
    if not trainable or any(p.requires_grad for p in pl_module.parameters(recurse=False)):
        return None
    for name, child in pl_module.named_children():
        if {id(p) for p in child.parameters() if p.requires_grad} == trainable:
            return name
    return None


def _multiplier(trainer: pl.Trainer, pl_module: pl.LightningModule) -> float | Tensor:
    """What Lightning multiplied a functional loss by before backward: 1/K under automatic
    optimization with ``accumulate_grad_batches=K``, times a GradScaler's current scale."""
    c: float | Tensor = 1.0
    if pl_module.automatic_optimization:
        c = 1.0 / trainer.accumulate_grad_batches
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    scale = None if scaler is None else compat.grad_scaler_scale(scaler)  # no host sync
    if scale is not None:
        c = scale.detach().double() * c
    return c


class _LoggerSink:
    """Scalars of each record to the Trainer's non-TensorBoard loggers."""

    def __init__(self, loggers: list) -> None:
        self._loggers = loggers

    def write(self, record: Record) -> None:
        scalars = flatten(record)
        if scalars:
            for logger in self._loggers:
                logger.log_metrics(scalars, step=record.step)

    def close(self) -> None:
        pass


def _logger_sinks(trainer: pl.Trainer) -> list[Any]:
    from gradlens.output.sinks import TensorBoardSink

    sinks: list[Any] = []
    others = []
    for logger in trainer.loggers:
        writer = getattr(logger, "experiment", None) if _is_tensorboard(logger) else None
        if writer is not None and hasattr(writer, "add_histogram_raw"):
            sinks.append(TensorBoardSink(writer))  # scalars and histograms; leaves the writer open
        else:
            others.append(logger)
    if others:
        sinks.append(_LoggerSink(others))
    return sinks


def _is_tensorboard(logger: Any) -> bool:
    return isinstance(logger, pl.loggers.TensorBoardLogger)
