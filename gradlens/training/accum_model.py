"""Automatic micro-batching: :class:`GradientAccumulateModel` trains on a large batch in
``accum_steps`` micro-batches with one optimizer update, exact for unequal splits (the window
gradient as :mod:`gradlens.training.accumulate` states it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from gradlens import compat
from gradlens.training.accum_checks import check_accum_steps, check_reduction
from gradlens.training.accum_optimizer import GradientAccumulateOptimizer

__all__ = ["GradientAccumulateModel"]


def _split_batch(batch: Any, accum_steps: int) -> tuple[list[tuple[Tensor, ...]], list[int]]:
    """``batch = (inputs..., target)`` split along dim 0 into at most ``accum_steps`` non-empty
    micro-batches (``torch.tensor_split``: sizes differ by at most one), and their sizes B_k."""
    if not isinstance(batch, (tuple, list)) or len(batch) < 2:
        raise TypeError(
            f"batch must be a tuple (inputs..., target) of tensors, e.g. (x, y), got "
            f"{type(batch).__name__}{'' if not isinstance(batch, (tuple, list)) else f' of length {len(batch)}'}."
        )
    for i, t in enumerate(batch):
        if not isinstance(t, Tensor) or t.dim() == 0:
            raise TypeError(
                f"batch[{i}] must be a tensor with a leading batch dimension, got "
                f"{type(t).__name__}{'' if not isinstance(t, Tensor) else ' with 0 dims'}."
            )
    n = batch[0].shape[0]
    sizes = [t.shape[0] for t in batch]
    if any(s != n for s in sizes):
        raise ValueError(
            f"every tensor of batch must have the same leading (batch) size, got {sizes}."
        )
    if n == 0:
        raise ValueError("batch is empty (leading size 0); skip the train_step call.")
    pieces = [torch.tensor_split(t, accum_steps) for t in batch]
    micro = [tuple(p[k] for p in pieces) for k in range(accum_steps) if pieces[0][k].shape[0] > 0]
    return micro, [m[0].shape[0] for m in micro]


class GradientAccumulateModel:
    """Trains on a large batch in ``accum_steps`` micro-batches with one optimizer update.

    :meth:`train_step` splits ``batch = (inputs..., target)`` along dim 0 into ``accum_steps``
    near-equal micro-batches (``torch.tensor_split``; sizes differ by at most one, and fewer
    micro-batches are used when the batch is smaller than ``accum_steps``), runs forward and
    backward on each in turn (peak activation memory is that of one micro-batch), and calls the
    optimizer once. Micro-step k computes ``loss_fn(model(*inputs_k), target_k)`` exactly as the
    user defines it (a mean over its B_k samples for ``reduction="mean"``, a sum for ``"sum"``);
    between backwards the accumulated ``p.grad`` is rescaled in place so that after the last one
    ``p.grad = sum_k B_k grad_k / N`` (mean) or ``sum_k grad_k`` (sum): exact for unequal splits.

    With a ``DistributedDataParallel`` model every micro-step but the last runs under
    ``model.no_sync()``, so gradients are all-reduced once per window. Every rank must pass
    batches of the same size (as DDP's gradient averaging itself assumes).

    Args:
        model: the module (or a ``DistributedDataParallel``) to train.
        optimizer: a ``torch.optim.Optimizer``; a :class:`GradientAccumulateOptimizer` with the
            same ``reduction`` is allowed (each ``train_step`` is then one of its micro-steps,
            reported with ``num_samples=N``).
        loss_fn: ``loss_fn(output, target) -> Tensor`` (a scalar).
        accum_steps: number of micro-batches per batch, >= 1.
        reduction: ``"mean"`` or ``"sum"``, how ``loss_fn`` reduces over a micro-batch.
        lens: optional gradlens ``Lens`` (anything with a ``capture()`` context manager); each
            micro-step's backward runs inside ``with lens.capture():``. During the capture the
            loss is the user's own micro-batch loss (never rescaled), but ``p.grad`` holds the
            running accumulation, not the micro-step's own gradient.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Optimizer,
        loss_fn: Callable[..., Tensor],
        accum_steps: int,
        *,
        reduction: str = "mean",
        lens: Any | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}; "
                f"pass e.g. torch.optim.SGD(model.parameters(), lr=0.1)."
            )
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable(output, target), got {type(loss_fn).__name__}.")
        self.accum_steps = check_accum_steps(accum_steps)
        self.reduction = check_reduction(reduction)
        if isinstance(optimizer, GradientAccumulateOptimizer) and optimizer.reduction != reduction:
            raise ValueError(
                f"optimizer has reduction={optimizer.reduction!r} but reduction={reduction!r} was "
                f"given; use the same reduction for both."
            )
        if lens is not None and not callable(getattr(lens, "capture", None)):
            raise TypeError(
                f"lens must be a gradlens Lens (an object with a capture() context manager) or "
                f"None, got {type(lens).__name__}."
            )
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.lens = lens

    def _is_ddp(self) -> bool:
        return isinstance(self.model, nn.parallel.DistributedDataParallel)

    def train_step(self, batch: Sequence[Tensor]) -> Tensor:
        """One window: forward/backward on every micro-batch of ``batch``, then one update.

        Args:
            batch: ``(inputs..., target)``, tensors with the same leading size N; the model is
                called as ``model(*inputs)`` and the loss as ``loss_fn(output, target)``.

        Returns:
            The window's loss, detached (no device sync): ``sum_k B_k loss_k / N`` for
            ``reduction="mean"`` (the mean loss over the N samples), ``sum_k loss_k`` for "sum".
        """
        micro, sizes = _split_batch(batch, self.accum_steps)
        n_total = sum(sizes)
        mean = self.reduction == "mean"
        params = [p for p in self.model.parameters() if p.requires_grad]
        ddp = self._is_ddp()
        self.optimizer.zero_grad(set_to_none=True)
        window_loss: Tensor | None = None
        last = len(micro) - 1
        for k, (*inputs, target) in enumerate(micro):
            sync = contextlib.nullcontext() if (not ddp or k == last) else self.model.no_sync()
            with sync:
                loss = self.loss_fn(self.model(*inputs), target)
                if not isinstance(loss, Tensor) or loss.dim() != 0:
                    raise ValueError(
                        f"loss_fn must return a scalar tensor, got "
                        f"{'shape ' + str(tuple(loss.shape)) if isinstance(loss, Tensor) else type(loss).__name__}; "
                        f"reduce it with reduction={self.reduction!r}."
                    )
                capture = self.lens.capture() if self.lens is not None else contextlib.nullcontext()
                with capture:
                    loss.backward()
            contribution = loss.detach() * sizes[k] if mean else loss.detach()
            window_loss = contribution if window_loss is None else window_loss + contribution
            if mean:
                # Invariant: after backward k, p.grad = sum_{j<=k} (B_j / B_k) grad_j.
                factor = sizes[k] / (sizes[k + 1] if k < last else n_total)
                if factor != 1.0:
                    grads = [p.grad for p in params if p.grad is not None]
                    if grads:
                        compat.foreach_mul_(grads, factor)
        if isinstance(self.optimizer, GradientAccumulateOptimizer):
            self.optimizer.step(num_samples=n_total)
        else:
            self.optimizer.step()
        window_loss = cast(Tensor, window_loss)  # _split_batch yields at least one micro-batch
        return window_loss / n_total if mean else window_loss
