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
from gradlens.lens.lens import Lens
from gradlens.lens.optimizers import unwrap_optimizer
from gradlens.core.records import Record, flatten
from gradlens.core.limits import CHUNK_ELEMENTS
from gradlens.measure.undefined import CONTRIBUTION

__all__ = ["LensTrainerCallback"]


class LensTrainerCallback(TrainerCallback):
    """Per-sample gradient statistics of a ``Trainer``'s model, one record per optimizer step.

    A window is one optimizer step of the Trainer: the ``gradient_accumulation_steps``
    micro-batches before it (fewer in the last window of an epoch); K micro-steps report exactly
    what one batch of N would. Creating the callback adds it to ``trainer``; the Lens is built
    when training begins (on ``trainer.model`` passed through :func:`gradlens.extend`, and on
    the optimizer inside the Trainer's ``AcceleratedOptimizer``).

    **The loss.** The callback takes the loss that the Trainer's ``compute_loss`` returns (the
    model's own ``outputs["loss"]``, a ``compute_loss_func``'s, or a subclass's) and opens
    ``lens.capture(reduction="mean", loss=loss)`` before the Trainer backpropagates it; the
    capture measures in backward what multiplied the loss (a ``1/K``, a GradScaler's scale) and
    divides it out, and closes after the backward (``on_substep_end`` /
    ``on_pre_optimizer_step``). Units (docs/design.md "Units"), for the two normalisations of
    the Trainer:

    * **Window-normalised (the Trainer's default for models that take** ``num_items_in_batch``
      **, and any** ``compute_loss_func`` **).** The Trainer counts the label tokens ``M`` of the
      whole window in advance and each micro-step backpropagates its summed token losses over
      ``M``, undivided by ``K``: the window's objective is ``L = sum_n L_n`` with
      ``L_n = (token losses of sequence n) / M``. Records use ``g_n = N * grad L_n`` with ``N``
      the window's sample count (sequences), so the window gradient ``mean_n g_n = grad L`` is
      the gradient the optimizer receives, and ``record["loss"]`` is ``L`` (the Trainer's logged
      ``loss`` of that step). ``record.meta["units"]`` says so.
    * **Per-micro-batch mean** (``trainer.model_accepts_loss_kwargs = False``, no
      ``compute_loss_func``): the loss is read as a mean over the ``B`` samples of the
      micro-batch, ``g_n = B * grad L_n``; the Trainer's ``1/K`` is divided out. Give
      ``reduction="sum"`` for a loss summed over samples (``g_n = grad L_n``).

    The Trainer's own flag ``trainer.loss_is_scaled_for_ga`` (when set) decides between the two,
    as it does for the Trainer. The window's sample count comes from the batches the Trainer
    fetches for the window (``get_batch_samples``): a sample is a row of ``input_ids`` (else
    of ``labels``, else of the first tensor of the batch).

    **DeepSpeed** (``TrainingArguments(deepspeed=config)``, ZeRO stages 1 to 3): the Lens takes
    Accelerate's ``DeepSpeedOptimizerWrapper`` and hooks DeepSpeed's optimizer inside it
    (:mod:`gradlens.distributed.deepspeed`). DeepSpeed updates inside ``accelerator.backward`` of
    the window's last micro-step; that capture ends first, the window closes there, and a step
    DeepSpeed skipped drops the window. On several processes the window's sample count (for the
    window-normalised loss) is summed over the ranks, one small all_reduce per window.

    **Not available:** ``Alpha`` needs each sample's loss at two consecutive parameter points,
    but the Trainer only ever sees the model's reduced loss; the callback refuses it (use the
    Lightning callback or a plain loop with ``lens.capture(losses=...)``).

    **Where records go.** :attr:`records`; the scalars of each record
    (:func:`gradlens.core.records.flatten`) into ``trainer.log`` at the end of the
    step, so they appear in ``trainer.state.log_history`` (at ``step = record.step + 1``, the
    Trainer's count of updates done) and reach every ``report_to`` integration; histograms
    through ``tensorboard=`` or ``sinks=[WandbSink()]``. The Trainer's own entries (``loss``,
    ``grad_norm``, ``learning_rate``) stay in the log history next to them, as separate entries
    of the same step.

    Args:
        trainer: the ``transformers.Trainer``; the callback adds itself to it.
        instruments: instances from :mod:`gradlens.instruments` (not ``Alpha``).
        reduction: how a per-micro-batch loss reduces over its samples (not used when the
            Trainer normalises the loss over the window).
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
        chunk_elements: int = CHUNK_ELEMENTS,
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
        self._queue: list[Record] = []
        self._window_samples: int | None = None
        self._units: str | None = None
        self._step_expected: int | None = None
        self._window_step: int | None = None  # lens.step when the current micro-step's capture opened
        #: the Trainer under DeepSpeed: ``accelerator.backward`` steps the engine inside the
        #: window's last backward call, and the Lens closes (or, on a step DeepSpeed skipped,
        #: drops) the window there itself (gradlens/distributed/deepspeed.py)
        self._updates_in_backward = False
        trainer.add_callback(self)

    @property
    def records(self) -> list[Record]:
        return self.lens.records if self.lens is not None else self._records

    # ------------------------------------------------------------------ lifecycle
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        trainer = self.trainer
        self._close()
        model = model if model is not None else trainer.model
        if not isinstance(model, nn.Module):
            raise TypeError(f"LensTrainerCallback: the Trainer's model is a {type(model).__name__}, not an nn.Module")
        optimizer = optimizer if optimizer is not None else trainer.optimizer
        # accelerate's AcceleratedOptimizer: the Lens watches the optimizer inside it and takes
        # its GradScaler (fp16) as grad_scaler
        inner = getattr(optimizer, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer) and unwrap_optimizer(optimizer)[0] is not inner:
            optimizer = inner
        # under DeepSpeed the Lens takes Accelerate's DeepSpeedOptimizerWrapper as it is and hooks
        # DeepSpeed's optimizer inside it (gradlens.distributed.deepspeed.resolve)
        self._updates_in_backward = bool(getattr(trainer, "is_deepspeed_enabled", False))
        sinks = [_UnitsNote(self)] + list(self._sinks)
        if self.log_history:
            sinks.append(_QueueSink(self._queue))
        self.lens = Lens(
            gradlens.extend(model), self.instruments, optimizer=optimizer, sinks=sinks,
            **self._lens_kwargs,
        )
        self._wrap(trainer)

    def on_train_end(self, args, state, control, **kwargs):
        self._close()
        self._flush_logs(control)

    def _wrap(self, trainer: Any) -> None:
        """Watch the Trainer's ``compute_loss`` (the loss it backpropagates),
        ``get_batch_samples`` (the window's batches, fetched before its first micro-step) and
        ``training_step`` (its backward done: the capture closes there, before the Trainer
        clips the gradients), as attributes of this Trainer only; :meth:`_close` restores them."""
        compute_loss, get_batch_samples = trainer.compute_loss, trainer.get_batch_samples
        training_step = trainer.training_step
        cb = self

        def watched_training_step(*args, **kw):
            out = training_step(*args, **kw)
            cb._end_micro_step()  # its backward is done: before the Trainer clips or unscales
            return out

        def watched_compute_loss(model, inputs, *args, **kw):
            b = _batch_size(inputs)  # before compute_loss pops the labels
            out = compute_loss(model, inputs, *args, **kw)
            return_outputs = kw.get("return_outputs", args[0] if args else False)
            num_items = kw.get("num_items_in_batch", args[1] if len(args) > 1 else None)
            cb._after_loss(model, out[0] if return_outputs else out, b, num_items)
            return out

        def watched_get_batch_samples(*args, **kw):
            batches, num_items = get_batch_samples(*args, **kw)
            sizes = [_batch_size(x) for x in batches]
            cb._window_samples = None if None in sizes else _over_ranks(sum(sizes), trainer)
            return batches, num_items

        watched_compute_loss._gradlens_wraps = compute_loss
        watched_get_batch_samples._gradlens_wraps = get_batch_samples
        watched_training_step._gradlens_wraps = training_step
        trainer.compute_loss = watched_compute_loss
        trainer.get_batch_samples = watched_get_batch_samples
        trainer.training_step = watched_training_step

    def _unwrap(self) -> None:
        trainer = self.trainer
        for name in ("compute_loss", "get_batch_samples", "training_step"):
            if hasattr(getattr(trainer, name, None), "_gradlens_wraps"):
                vars(trainer).pop(name, None)

    def _close(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            with contextlib.suppress(Exception):
                stack.__exit__(RuntimeError, RuntimeError("training ended"), None)
        self._unwrap()
        if self.lens is not None:
            self._records = self.lens.records
            self.lens.close()

    # ------------------------------------------------------------------ micro-steps
    def _window_normalised(self, num_items: Any) -> bool:
        """Whether the Trainer normalised this loss over the whole window (its own rule: it
        then does not divide the loss by the accumulation count)."""
        trainer = self.trainer
        flag = getattr(trainer, "loss_is_scaled_for_ga", None)
        if flag is not None:
            return bool(flag)
        return bool(
            (getattr(trainer, "model_accepts_loss_kwargs", False) and num_items is not None)
            or getattr(trainer, "compute_loss_func", None) is not None
        )

    def _after_loss(self, model: nn.Module, loss: Any, batch: int | None, num_items: Any) -> None:
        lens = self.lens
        if lens is None or not (torch.is_grad_enabled() and model.training):
            return
        if not (isinstance(loss, Tensor) and loss.dim() == 0 and loss.requires_grad):
            return
        if self._stack is not None:
            raise RuntimeError(
                "LensTrainerCallback: the Trainer computed two training losses before one "
                "backward; gradlens needs one forward and one backward per micro-step"
            )
        if self._window_normalised(num_items):
            n = self._window_samples
            if not n or not batch:
                raise RuntimeError(
                    "LensTrainerCallback: the Trainer normalises the loss over the window, but "
                    f"the window's sample count is unknown (micro-batch size {batch}, window "
                    f"{n}): the batches must be mappings of tensors whose first axis is the "
                    "sample axis (input_ids or labels [B, ...]); or set "
                    "trainer.model_accepts_loss_kwargs = False for a per-micro-batch mean loss"
                )
            # the loss is this micro-step's share of the window objective L (times R, the
            # ranks, whose gradients DDP / DeepSpeed average); as a mean over its B_k samples of
            # N * L_n (N the window's samples on all ranks) it was multiplied by R * B_k / N:
            # g_n = N * grad L_n
            capture = lens.capture("mean", loss=loss, multiplier=_world(self.trainer) * batch / n)
            self._units = "window"
        else:
            capture = lens.capture(self.reduction, loss=loss)
            self._units = None
        stack = contextlib.ExitStack()
        stack.enter_context(capture)
        self._stack = stack
        self._window_step = lens.step

    def _end_micro_step(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()  # the capture folds this micro-step into the window

    def on_substep_end(self, args, state, control, **kwargs):
        self._end_micro_step()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._end_micro_step()
        if self.lens is not None:  # (DeepSpeed: the window's index before its update, already made)
            self._step_expected = self._window_step if self._updates_in_backward else self.lens.step

    def on_optimizer_step(self, args, state, control, **kwargs):
        expected, self._step_expected = self._step_expected, None
        lens = self.lens
        if expected is not None and lens is not None and lens.step == expected and not self._updates_in_backward:
            lens.discard_window()  # the optimizer did not update (e.g. fp16 inf/nan): no record
        elif expected is not None and lens is not None and self._units == "window" and lens.records:
            record = lens.records[-1]
            if record.step == expected and record.num_samples != self._window_samples:
                raise RuntimeError(
                    f"LensTrainerCallback: window {expected} held {record.num_samples} samples "
                    "by the model's input but the Trainer's batches held "
                    f"{self._window_samples} rows, so its per-sample units (g_n = N * grad L_n) "
                    "are wrong; keep the samples on the first axis of input_ids (or labels), "
                    "or set trainer.model_accepts_loss_kwargs = False for a per-micro-batch mean"
                )

    def on_step_end(self, args, state, control, **kwargs):
        self._flush_logs(control)

    def _flush_logs(self, control: Any = None) -> None:
        queue, self._queue[:] = list(self._queue), []
        for record in queue:
            scalars = flatten(record)
            if scalars:
                # trainer.log() ends in on_log, which clears control.should_log: keep the
                # Trainer's own decision to log this step (its loss, grad_norm, learning_rate)
                should_log = getattr(control, "should_log", None)
                self.trainer.log(scalars)
                if should_log is not None:
                    control.should_log = should_log


def _world(trainer: Any) -> int:
    """The number of processes training, whose gradients DDP or DeepSpeed average (the default
    process group's size; 1 without torch.distributed)."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _over_ranks(n: int, trainer: Any) -> int:
    """``n`` summed over the ranks (one small all_reduce, on every rank as it fetches the
    window's batches) when the Trainer runs on several processes; ``n`` otherwise."""
    if _world(trainer) == 1:
        return n
    t = torch.tensor([n], dtype=torch.int64, device=trainer.args.device)
    torch.distributed.all_reduce(t)
    return int(t.item())


def _batch_size(inputs: Any) -> int | None:
    """Rows of a Trainer batch: ``input_ids``, else ``labels``, else its first tensor."""
    if isinstance(inputs, Tensor):
        return int(inputs.shape[0]) if inputs.dim() else None
    if isinstance(inputs, Mapping):
        for key in ("input_ids", "labels"):
            x = inputs.get(key)
            if isinstance(x, Tensor) and x.dim():
                return int(x.shape[0])
        for x in inputs.values():
            if isinstance(x, Tensor) and x.dim():
                return int(x.shape[0])
    return None


class _UnitsNote:
    """First sink: states the units of a window-normalised record in its meta."""

    def __init__(self, cb: LensTrainerCallback) -> None:
        self._cb = cb

    def write(self, record: Record) -> None:
        if self._cb._units == "window":
            record.meta["units"] = (
                "g_n = N * d(window objective)_n: the Trainer's loss normalised over the "
                "window's label tokens (mean objective; N the window's samples)"
            )
            if "contribution" in record.meta:  # Lens(undefined="contribution"): the definition stays
                record.meta["units"] += "; " + CONTRIBUTION

    def close(self) -> None:
        pass


class _QueueSink:
    def __init__(self, queue: list) -> None:
        self._queue = queue

    def write(self, record: Record) -> None:
        self._queue.append(record)

    def close(self) -> None:
        pass
