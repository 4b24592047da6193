"""Exact gradient accumulation: :class:`GradientAccumulateOptimizer` and :class:`GradientAccumulateModel`.

A *window* is one real optimizer update made of K micro-steps; micro-step k has B_k samples and
N = sum_k B_k. Both classes produce, for every window, exactly the gradient one batch of N would:

* ``reduction="mean"`` (the user's loss is a mean over its micro-batch, so ``p.grad`` after
  micro-step k is ``grad_k = (1 / B_k) sum_{n in k} g_n``): the window gradient is

      g = sum_k B_k * grad_k / sum_k B_k  =  (1 / N) sum_n g_n,

  with B_k the ``num_samples`` of micro-step k (all B_k = 1 when ``num_samples`` is never given,
  i.e. a plain average of the micro-step gradients);
* ``reduction="sum"`` (the user's loss is a sum over its micro-batch): g = sum_k grad_k.

The normalisation uses the counts the window actually holds, never K, so unequal micro-batches
and a partial last window (:meth:`GradientAccumulateOptimizer.flush`) stay exact.

This module is where both classes are imported from (``gradlens.GradientAccumulateOptimizer``,
and ``gradlens.accumulate`` of gradlens 0.1, are these). They are defined by concept:

- :mod:`gradlens.training.accum_optimizer`: the optimizer wrapper, :class:`GradientAccumulateOptimizer`;
- :mod:`gradlens.training.accum_state`: its window as one value, :class:`AccumulationState`, and
  the fold of a micro-step's gradient into it;
- :mod:`gradlens.training.accum_section`: the versioned ``"gradlens_accumulate"`` section of its
  ``state_dict`` (versions 1 and 2 read);
- :mod:`gradlens.training.accum_scaling`: GradScaler scales and windows with inf/nan;
- :mod:`gradlens.training.wrapped_optimizer`: the ``torch.optim.Optimizer`` interface over an
  inner optimizer (delegation, hook registries);
- :mod:`gradlens.training.accum_model`: automatic micro-batching, :class:`GradientAccumulateModel`;
- :mod:`gradlens.training.accum_checks`: the checks of ``accum_steps``, ``reduction`` and
  ``num_samples`` every accumulating component shares (:func:`check_accum_steps`).
"""

from __future__ import annotations

from gradlens.training.accum_checks import check_accum_steps  # noqa: F401 - imported from here
from gradlens.training.accum_model import GradientAccumulateModel
from gradlens.training.accum_optimizer import (  # noqa: F401 - the hook types, imported from here
    ClipFn,
    GradientAccumulateOptimizer,
    MicroStepHook,
    WindowEndHook,
    WindowGradHook,
)
from gradlens.training.accum_state import AccumulationState

__all__ = ["GradientAccumulateOptimizer", "GradientAccumulateModel", "AccumulationState"]
