"""Uses measured when a micro-step's backward ends, not when their output gradient arrives.

* **Shared parameters** (a tied embedding, a module called twice): g_n is the sum over the
  parameter's uses, so each use's contribution is kept (:func:`add_shared`; Linear-like uses as
  their factors, concatenated along positions when their parameters are used together) and
  measured once the backward has passed them all.
* **Small single uses, stacked** (:func:`stack`): when the plan asks only for per-sample norms
  of a use (``batch_l2``, and the window gradient sum_n g_n), uses whose kernel maths
  depend on nothing but their shapes (:meth:`gradlens.kernels.Kernel.stack_key`: Linear,
  Conv1D, LayerNorm, ...) are kept and measured together: their inputs and output gradients
  concatenated along the sample axis are one call of the kernel with ``k * B`` "samples" (the
  samples of a layer are independent, so each use's norms are its rows). On a model of many
  small layers this replaces ``k`` calls, each a dozen small tensor operations, by one; only
  uses of at most :data:`SMALL_USE` elements are kept, at most :data:`STACK_BUDGET` in all.
  Their window gradients come from one batched call too
  (:meth:`~gradlens.kernels.Kernel.stacked_grad_sum`, ``[k, *param]``) where that costs
  little (:func:`sums_here`): the Tap then hooks no autograd node of the use for its dL/dp.

:func:`measure` runs both at the end of the micro-step (:meth:`gradlens.measure.Meter.finish`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from gradlens import compat
from gradlens.capture import Site
from gradlens.kernels import OpLinear
from gradlens.units import MicroStep

__all__ = ["SMALL_SUM", "SMALL_USE", "STACK_BUDGET", "add_shared", "measure", "stack", "stack_key", "sums_here"]

#: largest use (elements of its input and output gradient) kept for stacking
SMALL_USE = 1 << 17
#: most elements of the uses one micro-step keeps for stacking (beyond: measured at once)
STACK_BUDGET = 1 << 22
#: most multiply-adds of a stacked use's window gradient (:meth:`~gradlens.kernels.Kernel.sum_cost`)
#: formed here rather than taken from autograd through a node hook (which costs about as much
#: as a product of this size on a CPU)
SMALL_SUM = 1 << 19


def sums_here(site: Site, a: Tensor, out: Tensor) -> bool:
    """Whether a use (``a`` its input, ``out`` its output) is small enough to be stacked and to
    have its window gradient formed with the stacked ones, not delivered by autograd."""
    return a.numel() + out.numel() <= SMALL_USE and site.kernel.sum_cost(site.module, a, out) <= SMALL_SUM


def add_shared(micro: MicroStep, site: Site, a: Tensor, delta: Tensor) -> None:
    """Add a use of shared parameters into ``micro.shared`` (qualified name -> ``[B, *param]``
    per-sample gradients summed over the uses so far)."""
    pending = [attr for attr, q in site.params.items() if q not in micro.shared]
    got = site.kernel.per_sample(site.module, a, delta, 0, delta.shape[0], attrs=pending) if pending else {}
    for attr, q in site.params.items():
        if q in micro.shared:  # a later use: added in place (no [B, *param] temporary)
            site.kernel.add_per_sample(site.module, a, delta, attr, micro.shared[q])
        else:  # owned: later uses add into it, and a, delta may be kept by other measurements
            g = got[attr]
            micro.shared[q] = g.clone() if _shares_storage(g, a) or _shares_storage(g, delta) else g


def stack_key(site: Site, split: list) -> tuple | None:
    """What stacking a use of ``site`` depends on besides its shapes (None: never stacked):
    its kernel, :meth:`~gradlens.kernels.Kernel.stack_key`, and its parameters by group
    (``split``: ``[(group, {attr: name})]``, one entry ``(None, ...)`` without groups)."""
    key = site.kernel.stack_key(site.module, tuple(site.params))
    if key is None:
        return None
    return (type(site.kernel), key, tuple(tuple(names) for _, names in split)), split


def stack(micro: MicroStep, site: Site, a: Tensor, delta: Tensor, static: tuple, via=()) -> bool:
    """Keep a single use for :func:`measure` (True) if it fits; False: measure it now.
    ``delta``: its output gradient as autograd gave it (:func:`measure` applies the micro-step's
    per-sample scale); ``static``: its :func:`stack_key`; ``via``: attributes whose window
    gradient a hook on the use's autograd node delivers (not summed here)."""
    size = a.numel() + delta.numel()
    if size > SMALL_USE or micro.stacked_elements + size > STACK_BUDGET:
        return False
    key, split = static
    micro.stacked.setdefault((key, a.shape[1:], delta.shape[1:], a.dtype, delta.dtype), []).append(
        (site, a, delta, split, via))
    micro.stacked_elements += size
    return True


def measure(meter, micro: MicroStep) -> None:
    """Measure what the micro-step kept: the stacked small uses (their ``[B]`` norms and, if
    wanted, window gradients), then the shared parameters (each one's g_n summed over its
    uses), through ``meter`` (the :class:`gradlens.measure.Meter` whose micro-step ends)."""
    acc = {"sum_grad_squared": meter.window.sum_grad_squared, "grad_sum": meter.window.grad_sum}  # (untouched)
    scale = micro.scale() if micro.stacked else 1.0  # the uses' output gradients are kept unscaled
    sq = scale ** 2
    sums = "grad_sum" in meter.use_sums
    for uses in micro.stacked.values():
        site0, _, _, split0, _ = uses[0]
        b, k = uses[0][2].shape[0], len(uses)
        a = torch.cat([u[1] for u in uses]) if k > 1 else uses[0][1]
        d = torch.cat([u[2] for u in uses]) if k > 1 else uses[0][2]
        # window gradients of the attributes no autograd-node hook delivers (for every use)
        attrs = [attr for attr in site0.params if any(attr not in u[4] for u in uses)] if sums else []
        l2, got = site0.kernel.stacked_reduce(site0.module, a, d, k, [names for _, names in split0], attrs, acc)
        if got:
            _add_stacked_sums(uses, got, scale, acc["grad_sum"], meter.sum_blocks)
        for j in range(len(split0)):  # the same attributes per group in every use
            groups = {u[3][j][0] for u in uses}
            for part in l2[j]:
                rows = part.view(k, b)
                if len(groups) == 1:
                    meter._add_l2(micro, (rows.sum(0) if k > 1 else rows[0]) * sq, next(iter(groups)))
                else:
                    for i, u in enumerate(uses):
                        meter._add_l2(micro, rows[i] * sq, u[3][j][0])
    micro.stacked, micro.stacked_elements = {}, 0
    linear: dict[tuple, list] = {}
    for site, a, delta in micro.linear_uses:
        linear.setdefault(tuple(sorted(site.params.items())), []).append((site, a, delta))
    owners: dict[str, int] = {}
    for key in linear:
        for _, q in key:
            owners[q] = owners.get(q, 0) + 1
    for key, uses in linear.items():
        if any(owners[q] > 1 or q in micro.shared for _, q in key):
            for site, a, delta in uses:
                add_shared(micro, site, a, delta)
            continue
        site0 = uses[0][0]
        b = uses[0][2].shape[0]
        a = torch.cat([u[1].reshape(b, -1, u[1].shape[-1]) for u in uses], dim=1)
        d = torch.cat([u[2].reshape(b, -1, u[2].shape[-1]) for u in uses], dim=1)
        m = site0.module
        attrs = tuple(attr for attr, _ in key)
        stand_in = OpLinear(m.weight, getattr(m, "bias", None), attrs)
        name = "+".join(q for _, q in key) + "#uses"
        meter._measure(Site(name, stand_in, site0.kernel, dict(key)), a, d, micro)
    for q, g in micro.shared.items():
        meter._measure_materialised(f"{q}#uses", q, g, micro)
    micro.linear_uses, micro.shared = [], {}


def _add_stacked_sums(uses: list, got: dict[str, Tensor], scale, acc: dict, blocks: dict) -> None:
    """sum_n g_n of each stacked use (``got``: attribute -> ``[k, *param]``, times the
    per-sample ``scale`` here) into the window's ``acc``. The first micro-step's ``[k, *param]``
    block becomes the uses' accumulators (row i is use i's; remembered in ``blocks``, the
    Meter's); a later micro-step whose uses are the same adds its block onto that one in one
    operation (if ``acc`` still holds those rows)."""
    for attr, g in got.items():
        qs = tuple(u[0].params[attr] for u in uses if attr not in u[4])
        if len(qs) == len(uses):
            block = blocks.get((attr, qs))
            if block is not None and all(acc.get(q) is r for q, r in zip(qs, block[1])):
                if isinstance(scale, Tensor):
                    block[0].addcmul_(g, scale)
                else:
                    block[0].add_(g, alpha=scale)
                continue
        rows = g.mul_(scale).unbind(0)
        if len(qs) == len(uses) and not any(q in acc for q in qs):
            if len(blocks) > 256:  # (stale entries fail the check above: dropping them is safe)
                blocks.clear()
            blocks[attr, qs] = (g, rows)
        dst, src = [], []
        for u, row in zip(uses, rows):
            if attr in u[4]:
                continue
            q = u[0].params[attr]
            if q in acc:
                dst.append(acc[q])
                src.append(row)
            else:
                acc[q] = row
        if dst:
            compat.foreach_add_(dst, src)


def _shares_storage(t: Tensor, other: Tensor) -> bool:
    """Whether ``t`` is a view into ``other``'s memory (e.g. a 2-D Linear's per-sample bias
    gradient, which is its output gradient itself)."""
    return t.untyped_storage().data_ptr() == other.untyped_storage().data_ptr()
