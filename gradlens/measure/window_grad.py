"""The window gradient sum_n g_n and the micro-steps' ||dL/dtheta||^2, from what autograd computes
anyway: a mixin of :class:`gradlens.measure.meter.Meter`.

* :meth:`WindowGradient.on_weight_grad`: autograd's dL/dp of one single-use layer call (Linear,
  Conv1D, LayerNorm, Embedding), from a hook on that call's own autograd node
  (:func:`gradlens.capture.param_grads._hook_param_grads`): sum_n g_n of the call is that times the
  micro-step's per-sample scale; a regulariser or another use of the parameter does not reach
  that node. Small ones are kept and added at the micro-step's end in one pass.
* :meth:`WindowGradient.on_param_grad`: light capture (:class:`gradlens.capture.light.ParamTap`, for
  instruments of the window gradient only): a parameter's dL/dp in this backward.
* :meth:`WindowGradient.on_grad_sq`: ||dL/dp||^2 of the parameter hooks of "micro_grad_sq".

The sums go straight into the window's accumulators (``window.stats.grad_sum``, per-sample units).
"""

from __future__ import annotations

import torch
from torch import Tensor

from gradlens.capture.dtensor import is_dtensor
from gradlens.capture.events import Site
from gradlens.compat import dtensor_local
from gradlens.core.sq_norms import sq_norm
from gradlens.capture.units import MicroStep, check_reduction
from gradlens.core.limits import SMALL_GRAD as _SMALL_GRAD

__all__ = ["WindowGradient"]



class WindowGradient:
    """The Meter's handling of autograd's own gradients (see the module docstring). Uses the
    Meter's ``micro``, ``window``, ``tap``, ``plan`` and ``_in_backward``."""

    def on_grad_sq(self, sq: Tensor) -> None:
        """||dL/dp||^2 of tracked parameters (0-d), summed into the micro-step's "micro_grad_sq"."""
        micro = self.micro
        if micro is not None:
            micro.grad_sq = sq if micro.grad_sq is None else micro.grad_sq + sq

    def on_weight_grad(self, w: Site, grad: Tensor | None, attr: str = "weight") -> None:
        """Autograd's dL/dp of parameter ``attr`` of one layer call (Linear, Conv1D, LayerNorm,
        Embedding; see :func:`gradlens.capture.param_grads._hook_param_grads`): sum_n g_n of it is that
        times the per-sample scale; no extra matmul or materialised sum."""
        micro = self.micro
        if micro is None or grad is None or self.window is None:
            return
        key = w.params.get(attr)
        if key is None or key not in self.tap.params or self.tap.uses[key] > 1 or key in self.silent:
            return
        if grad.numel() <= _SMALL_GRAD:  # added with the micro-step's others (finish)
            micro.grad_parts.append((key, grad))
        else:
            self._add_grad_sum(key, grad, micro.scale())

    def _add_grad_parts(self, micro: MicroStep) -> None:
        """The small dL/dp that :meth:`on_weight_grad` kept, into the window's ``grad_sum``, in
        one pass (one no-grad context, one scale, no call per gradient)."""
        parts, micro.grad_parts = micro.grad_parts, []
        scale = micro.scale()
        acc = self.window.stats.grad_sum
        with torch.no_grad():
            for key, grad in parts:
                if key not in acc:
                    self._add_grad_sum(key, grad, scale)
                elif isinstance(scale, Tensor):
                    acc[key].addcmul_(grad, scale)
                else:
                    acc[key].add_(grad, alpha=scale)

    def _add_grad_sum(self, key: str, grad: Tensor, scale: float | Tensor) -> None:
        """``grad_sum[key] += scale * grad`` (a buffer of the pool on the first add)."""
        with torch.no_grad():
            acc = self.window.stats.grad_sum
            if key in acc:
                if isinstance(scale, Tensor):
                    acc[key].addcmul_(grad, scale)
                else:
                    acc[key].add_(grad, alpha=scale)
                return
            dtype = grad.dtype if grad.dtype in (torch.float32, torch.float64) else torch.float32
            out = acc.buffer(key, tuple(grad.shape), grad.to(dtype) if dtype != grad.dtype else grad)
            acc[key] = torch.mul(grad, scale, out=out)

    def on_param_grad(self, q: str, grad: Tensor) -> None:
        """Light capture (:class:`~gradlens.capture.light.ParamTap`): dL/dp of parameter ``q`` in this
        backward, before it reaches ``p.grad``: the micro-step's squared norm and the window's
        gradient sum, in per-sample units."""
        if self.micro is None and not self.tap.installed:  # hooks of a window already closed
            return
        micro = self._in_backward(q)
        if micro is None:
            return
        if q in self.silent:  # tensor parallelism: a replicated parameter TP rank 0 counts
            grad = None
        elif is_dtensor(grad):  # tensor parallelism: this rank's block (summed over the TP group)
            grad = dtensor_local(grad)
        if not micro.seen:  # the first gradient of this backward
            micro.resolve()
            if micro.batch_size is None:
                micro.batch_size = self.tap.batch
            if micro.batch_size is None:
                raise RuntimeError(
                    "gradlens found no batch size for this micro-step: neither an extended loss "
                    "module nor the model's forward saw the input; compute the loss with "
                    "gradlens.extend(loss_fn), or run the forward through the watched model"
                )
            if micro.reduction is not None:
                check_reduction(self.window.stats, micro.reduction)
            if micro.batch_size == 0:
                micro.empty = True
        micro.seen.add(q)
        if micro.empty or grad is None:
            return
        g = grad.detach()
        if g.is_sparse:
            g = g.to_dense()
        if "micro_grad_sq" in self.plan.needs:
            sq = sq_norm(g)
            micro.grad_sq = sq if micro.grad_sq is None else micro.grad_sq + sq
        if "grad_sum" in self.plan.needs:
            self._add_grad_sum(q, g, micro.scale())

