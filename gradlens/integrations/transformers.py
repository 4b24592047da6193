"""Hugging Face ``Trainer``: a ``TrainerCallback`` that attaches a :class:`~gradlens.Lens`.

Imports ``transformers`` only when this module is imported. Example::

    from gradlens.integrations.transformers import LensTrainerCallback
    from gradlens.instruments import BatchL2, GradNorm, GradHist1d

    trainer = Trainer(model=model, args=TrainingArguments(..., gradient_accumulation_steps=3),
                      train_dataset=ds)
    lens_cb = LensTrainerCallback(trainer, [BatchL2(), GradNorm(), GradHist1d()])
    trainer.train()
    lens_cb.records[-1]["grad_norm"]          # also in trainer.state.log_history
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterable, Mapping, Sequence

try:
    from transformers import TrainerCallback
except ImportError as err:  # pragma: no cover
    raise ImportError(
        "gradlens.integrations.transformers needs Hugging Face transformers: pip install transformers"
    ) from err

import torch
from torch import Tensor, nn

import gradlens
from gradlens.instruments import Alpha
from gradlens.instruments.base import Instrument
from gradlens.lens import Lens
from gradlens.records import Record, flatten

__all__ = ["LensTrainerCallback"]


class LensTrainerCallback(TrainerCallback):
    """Per-sample gradient statistics of a ``Trainer``'s model, one record per optimizer step.

    A window is one optimizer step of the Trainer: the ``gradient_accumulation_steps``
    micro-batches before it (fewer in the last window of an epoch); K micro-steps report exactly
    what one batch of N would. Creating the callback adds it to ``trainer``; the Lens is built
    when training begins (on ``trainer.model`` passed through :func:`gradlens.extend`, and on
    the optimizer inside the Trainer's ``AcceleratedOptimizer``).

    **The model's own loss.** The Trainer backpropagates the ``loss`` the model returns
    (``outputs["loss"]``, or ``outputs[0]``) after dividing it by the number of micro-steps of
    the window (and, under fp16, multiplying it by a GradScaler's scale). A forward hook on the
    model opens ``lens.capture(reduction, loss=outputs["loss"])`` right after the forward; the
    capture measures in backward what multiplied the loss and divides it out, and closes after
    the backward (``on_substep_end`` / ``on_pre_optimizer_step``). Units (DESIGN.md): the
    loss is read as a mean over the ``B`` samples of the micro-batch (``reduction="mean"``),
    so ``g_n = B * grad L_n``; for a token-mean cross-entropy over sequences of equal
    length that is the gradient of sample n's own token-mean loss. (With padding, the
    token-mean divides by the micro-batch's token count; ``g_n`` stays ``B * grad L_n``.) Give
    ``reduction="sum"`` for a loss summed over samples (``g_n = grad L_n``).

    Models that take ``num_items_in_batch`` (``**kwargs`` in ``forward``) or a
    ``compute_loss_func`` normalise the loss by the token count of the whole window, which is
    not a per-micro-batch mean: the callback refuses them with a clear error; set
    ``trainer.model_accepts_loss_kwargs = False`` to get the per-micro-batch mean.

    **Not available:** ``Alpha`` needs each sample's loss at two consecutive parameter points,
    but the Trainer only ever sees the model's reduced loss; the callback refuses it (use the
    Lightning callback or a plain loop with ``lens.capture(losses=...)``).

    **Where records go.** :attr:`records`; the scalars of each record
    (:func:`gradlens.records.flatten`) into ``trainer.log`` at the end of the
    step, so they appear in ``trainer.state.log_history`` (at ``step = record.step + 1``, the
    Trainer's count of updates done) and reach every ``report_to`` integration; histograms
    through ``tensorboard=`` or ``sinks=[WandbSink()]``.

    Args:
        trainer: the ``transformers.Trainer``; the callback adds itself to it.
        instruments: instances from :mod:`gradlens.instruments` (not ``Alpha``).
        reduction: how the model's loss reduces over the samples of a micro-batch.
        log_history: write scalars through ``trainer.log``.
        every, exclude, log, tensorboard, sinks, keep_records, chunk_elements: as for
            :class:`~gradlens.Lens`.
    """

    def __init__(
        self,
        trainer: Any,
        instruments: Sequence[Instrument],
        *,
        reduction: str = "mean",
        log_history: bool = True,
        every: int | Callable[[int], bool] = 1,
        exclude: Iterable[str] = (),
        log: str | os.PathLike | None = None,
        tensorboard: Any = None,
        sinks: Iterable[Any] = (),
        keep_records: bool = True,
        chunk_elements: int = 1 << 20,
    ) -> None:
        if not (callable(getattr(trainer, "add_callback", None)) and hasattr(trainer, "log")):
            raise TypeError(
                "LensTrainerCallback(trainer=...) takes the transformers.Trainer to watch, got "
                f"{type(trainer).__name__}; create the Trainer first, then the callback"
            )
        instruments = list(instruments)
        for inst in instruments:
            if not isinstance(inst, Instrument):
                raise TypeError(
                    f"LensTrainerCallback(instruments=...) takes gradlens.instruments objects, got "
                    f"{inst!r}; did you pass the class instead of an instance?"
                )
            if isinstance(inst, Alpha):
                raise ValueError(
                    "LensTrainerCallback cannot run Alpha: it needs every sample's own loss at "
                    "this window's and the next window's parameters, and the Trainer only sees "
                    "the model's reduced loss; drop Alpha() (or use a plain loop with "
                    "lens.capture(losses=...), or the Lightning callback with report_losses)"
                )
        if reduction not in ("mean", "sum"):
            raise ValueError(
                f"LensTrainerCallback(reduction=...) must be 'mean' or 'sum' (how the model's "
                f"loss reduces over the samples of a micro-batch), got {reduction!r}"
            )
        self.trainer = trainer
        self.instruments = instruments
        self.reduction = reduction
        self.log_history = log_history
        self._lens_kwargs = dict(
            every=every, exclude=tuple(exclude), log=log, tensorboard=tensorboard,
            keep_records=keep_records, chunk_elements=chunk_elements,
        )
        self._sinks = list(sinks)
        self.lens: Lens | None = None
        self._records: list[Record] = []
        self._stack: contextlib.ExitStack | None = None
        self._hook = None
        self._queue: list[Record] = []
        self._step_expected: int | None = None
        trainer.add_callback(self)

    @property
    def records(self) -> list[Record]:
        return self.lens.records if self.lens is not None else self._records

    # ------------------------------------------------------------------ lifecycle
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        trainer = self.trainer
        if getattr(trainer, "model_accepts_loss_kwargs", False) or getattr(trainer, "compute_loss_func", None):
            raise ValueError(
                "LensTrainerCallback: this Trainer normalises the loss by the token count of the "
                "whole window (the model takes num_items_in_batch, or compute_loss_func is set), "
                "so the loss is not a mean over the micro-batch and per-sample gradients are "
                "ambiguous; set trainer.model_accepts_loss_kwargs = False (and no "
                "compute_loss_func) before trainer.train()"
            )
        self._close()
        model = model if model is not None else trainer.model
        if not isinstance(model, nn.Module):
            raise TypeError(f"LensTrainerCallback: the Trainer's model is a {type(model).__name__}, not an nn.Module")
        optimizer = optimizer if optimizer is not None else trainer.optimizer
        inner = getattr(optimizer, "optimizer", None)  # accelerate's AcceleratedOptimizer
        if isinstance(inner, torch.optim.Optimizer):
            optimizer = inner
        sinks = list(self._sinks)
        if self.log_history:
            sinks.append(_QueueSink(self._queue))
        self.lens = Lens(
            gradlens.extend(model), self.instruments, optimizer=optimizer, sinks=sinks,
            **self._lens_kwargs,
        )
        self._hook = model.register_forward_hook(self._after_forward)

    def on_train_end(self, args, state, control, **kwargs):
        self._close()
        self._flush_logs()

    def _close(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            with contextlib.suppress(Exception):
                stack.__exit__(RuntimeError, RuntimeError("training ended"), None)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.lens is not None:
            self._records = self.lens.records
            self.lens.close()

    # ------------------------------------------------------------------ micro-steps
    def _after_forward(self, module: nn.Module, inputs, output) -> None:
        lens = self.lens
        if lens is None or not (torch.is_grad_enabled() and module.training):
            return
        loss = _loss_of(output)
        if loss is None or not loss.requires_grad:
            return
        if self._stack is not None:
            raise RuntimeError(
                "LensTrainerCallback: the model ran two training forwards before one backward; "
                "gradlens needs one forward and one backward per micro-step"
            )
        stack = contextlib.ExitStack()
        stack.enter_context(lens.capture(self.reduction, loss=loss))
        self._stack = stack

    def _end_micro_step(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()  # the capture folds this micro-step into the window

    def on_substep_end(self, args, state, control, **kwargs):
        self._end_micro_step()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._end_micro_step()
        if self.lens is not None:
            self._step_expected = self.lens.step

    def on_optimizer_step(self, args, state, control, **kwargs):
        expected, self._step_expected = self._step_expected, None
        lens = self.lens
        if expected is not None and lens is not None and lens.step == expected:
            lens.discard_window()  # the optimizer did not update (e.g. fp16 inf/nan): no record

    def on_step_end(self, args, state, control, **kwargs):
        self._flush_logs()

    def _flush_logs(self) -> None:
        queue, self._queue[:] = list(self._queue), []
        for record in queue:
            scalars = flatten(record)
            if scalars:
                self.trainer.log(scalars)


def _loss_of(output: Any) -> Tensor | None:
    if isinstance(output, Tensor):
        return output if output.dim() == 0 else None
    if isinstance(output, Mapping):
        loss = output.get("loss")
    elif isinstance(output, (tuple, list)) and output:
        loss = output[0]
    else:
        loss = getattr(output, "loss", None)
    return loss if isinstance(loss, Tensor) and loss.dim() == 0 else None


class _QueueSink:
    def __init__(self, queue: list) -> None:
        self._queue = queue

    def write(self, record: Record) -> None:
        self._queue.append(record)

    def close(self) -> None:
        pass
