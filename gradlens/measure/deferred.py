"""Uses measured when a micro-step's backward ends, not when their output gradient arrives.

* **Shared parameters** (a tied embedding, a module called twice): g_n is the sum over the
  parameter's uses, so each use's contribution is kept (:func:`add_shared`; Linear-like uses as
  their factors, concatenated along positions when their parameters are used together) and
  measured once the backward has passed them all.
* **Small single uses, stacked** (:func:`stack`): when the plan asks only for per-sample norms
  of a use (``batch_l2``, and the sums over samples: the window gradient sum_n g_n and the
  sum of squares sum_n g_n * g_n), uses whose kernel maths
  depend on nothing but their shapes (:meth:`gradlens.kernels.Kernel.stack_key`: Linear,
  Conv1D, LayerNorm, ...) are kept until the window's end and measured together: each site's
  inputs and output gradients over the window's micro-steps, and the sites one after the
  other, concatenated along the sample axis are one call of the kernel with ``k * N``
  "samples" (the samples of a layer are independent, so each use's norms are its rows). On a
  model of many small layers this replaces ``k * K`` calls (K micro-steps), each a dozen small
  tensor operations, by one; only uses of at most :data:`SMALL_USE` elements are kept, at
  most :data:`STACK_BUDGET` in all (beyond: measured at once). Sums of squares need the
  per-sample gradients: one materialising pass per stacked call (only for uses whose
  ``[B, *param]`` is small) gives them with the norms and window gradients. Otherwise the
  window gradients come
  from one batched call too (:meth:`~gradlens.kernels.Kernel.stacked_grad_sum`,
  ``[k, *param]``) where that costs little (:func:`sums_here`): the Tap then hooks no
  autograd node of the use for its dL/dp.

:func:`measure` runs at the end of the micro-step (:meth:`gradlens.measure.meter.Meter.finish`);
:func:`carry` keeps its stacked uses in the :class:`~gradlens.core.window.Window` when it folds
into it, :func:`settle` measures them before anything reads the window
(:meth:`gradlens.measure.meter.Meter.settle`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from gradlens import compat
from gradlens.capture.events import Site
from gradlens.kernels.linear import OpLinear
from gradlens.capture.units import MicroStep
from gradlens.core.limits import SMALL_SUM, SMALL_USE, STACK_BUDGET
from gradlens.core.window import Window

__all__ = [
    "SMALL_SUM", "SMALL_USE", "STACK_BUDGET", "add_shared", "carry", "fits", "measure", "settle", "stack",
    "stack_key", "sums_here",
]



def fits(elements: int, batch: int, materialised: int = 0) -> bool:
    """Whether a use may be kept for stacking by its size: ``elements`` numbers of its input
    and output gradient, ``batch`` samples of ``materialised`` gradient elements each where
    the plan wants sums of squares (0: not formed)."""
    return elements <= SMALL_USE and batch * materialised <= SMALL_USE


def sums_here(site: Site, a: Tensor, out: Tensor) -> bool:
    """Whether a use (``a`` its input, ``out`` its output) is small enough to be stacked and to
    have its window gradient formed with the stacked ones, not delivered by autograd."""
    return a.numel() + out.numel() <= SMALL_USE and site.kernel.sum_cost(site.module, a, out) <= SMALL_SUM


def add_shared(micro: MicroStep, site: Site, a: Tensor, delta: Tensor) -> None:
    """Keep a use of shared parameters (``micro.shared_uses``: qualified name -> its uses), to be
    summed when the micro-step ends (:func:`measure`)."""
    for attr, q in site.params.items():
        micro.shared_uses.setdefault(q, []).append((site, attr, a, delta))


def _summed(uses: list, dense: Tensor | None) -> Tensor:
    """``[B, *param]``: the per-sample gradients of one shared parameter summed over its uses
    ``[(site, attr, a, delta)]`` (and ``dense``, the per-operation uses' sum, added into)."""
    g = dense
    for site, attr, a, delta in uses:
        if g is None:
            g = site.kernel.per_sample(site.module, a, delta, 0, delta.shape[0], attrs=[attr])[attr]
            if _shares_storage(g, a) or _shares_storage(g, delta):  # a view: later uses add into it
                g = g.clone()
        else:  # a later use: added in place (no [B, *param] temporary)
            site.kernel.add_per_sample(site.module, a, delta, attr, g)
    return g


def stack_key(site: Site, split: list) -> tuple | None:
    """What stacking a use of ``site`` depends on besides its shapes (None: never stacked):
    its kernel, :meth:`~gradlens.kernels.Kernel.stack_key`, and its parameters by group
    (``split``: ``[(group, {attr: name})]``, one entry ``(None, ...)`` without groups)."""
    key = site.kernel.stack_key(site.module, tuple(site.params))
    if key is None:
        return None
    return (type(site.kernel), key, tuple(tuple(names) for _, names in split)), split


def stack(micro: MicroStep, site: Site, a: Tensor, delta: Tensor, static: tuple, via=(), made: bool = False,
          materialised: int = 0) -> bool:
    """Keep a single use for :func:`settle` (True) if it fits; False: measure it now.
    ``delta``: its output gradient as autograd gave it (:func:`settle` applies the micro-step's
    per-sample scale); ``static``: its :func:`stack_key`; ``via``: attributes whose window
    gradient a hook on the use's autograd node delivers (not summed here); ``made``: ``a`` was
    made by this forward's autograd graph (else it is copied: a later forward may write into
    data or a buffer before the window ends); ``materialised``: the elements of one sample's
    gradient when the plan wants sums of squares (:func:`settle` then forms the per-sample
    gradients: a use whose ``[B, *param]`` exceeds :data:`SMALL_USE` is measured now, by its
    kernel's own, possibly factored, maths)."""
    size = a.numel() + delta.numel()
    if not fits(size, delta.shape[0], materialised) or micro.stacked_elements + size > STACK_BUDGET:
        return False
    key, split = static
    micro.stacked.setdefault((key, a.shape[1:], delta.shape[1:], a.dtype, delta.dtype), []).append(
        (site, a if made else a.clone(), delta, split, via))
    micro.stacked_elements += size
    return True


def measure(meter, micro: MicroStep) -> None:
    """Measure the shared parameters the micro-step kept (each one's g_n summed over its uses),
    through ``meter`` (the :class:`gradlens.measure.meter.Meter` whose micro-step ends: its
    :meth:`~gradlens.measure.meter.Meter.measure_use` and
    :meth:`~gradlens.measure.meter.Meter.measure_param`). Its stacked small uses wait for the
    window (:func:`carry`, :func:`settle`)."""
    linear: dict[tuple, list] = {}
    for site, a, delta in micro.linear_uses:
        linear.setdefault(tuple(sorted(site.params.items())), []).append((site, a, delta))
    owners: dict[str, int] = {}
    for key in linear:
        for _, q in key:
            owners[q] = owners.get(q, 0) + 1
    for key, uses in linear.items():
        if any(owners[q] > 1 or q in micro.shared or q in micro.shared_uses for _, q in key):
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
        meter.measure_use(Site(name, stand_in, site0.kernel, dict(key)), a, d, micro)
    for q in {**micro.shared, **micro.shared_uses}:
        uses, dense = micro.shared_uses.get(q, []), micro.shared.get(q)
        if dense is None and not meter.plan.layer:  # one slice of samples at a time
            meter.measure_summed(f"{q}#uses", q, uses, micro)
        else:  # layer instruments keep the [B, *param] tensor itself
            meter.measure_param(f"{q}#uses", q, _summed(uses, dense), micro)
    micro.linear_uses, micro.shared, micro.shared_uses = [], {}, {}


def carry(window: Window, micro: MicroStep, index: int) -> None:
    """Keep the micro-step's stacked uses for the window's end (``window.carried``: stack key ->
    blocks, one per micro-step: the uses' sites, the uses, the micro-step's per-sample scale,
    its batch size and its place ``index`` among the window's ``batch_l2`` vectors)."""
    scale = micro.scale()
    for key, uses in micro.stacked.items():
        sites = tuple((u[0].name, tuple(u[0].params.items()), u[4]) for u in uses)
        window.carried.setdefault(key, []).append((sites, uses, scale, uses[0][2].shape[0], index))
    window.carried_elements += micro.stacked_elements
    micro.stacked, micro.stacked_elements = {}, 0


def settle(window: Window, use_sums: frozenset) -> None:
    """Measure the stacked uses ``window`` carries into its statistics (``use_sums``: the sums
    the plan wants, :attr:`gradlens.measure.meter.Meter.use_sums`). Per stack key and set of
    sites, the uses are concatenated site by site (each site's samples over the window, then
    the next site's) and scaled to per-sample units (each micro-step its own scale), so that
    every site's norms, window gradient and sum of squares (what the plan wants) come from one
    call (:meth:`~gradlens.kernels.Kernel.stacked_reduce`); the ``[N]`` norms are added to the
    micro-steps' ``batch_l2`` (and ``group_l2``) vectors, the sums into the window's
    accumulators."""
    carried = window.carried
    if not carried:
        return
    window.carried, window.carried_elements = {}, 0
    stats = window.stats
    acc = {"sum_grad_squared": stats.sum_grad_squared, "grad_sum": stats.grad_sum}  # (untouched)
    totals, squares = "grad_sum" in use_sums, "sum_grad_squared" in use_sums
    parts: dict[tuple, dict] = {}  # micro-steps (their indices) -> group -> [k, N] norms of uses
    scales: dict[tuple, Tensor | None] = {}  # (micro-steps, dtype, device) -> [1, N, 1] per-sample scale
    for blocks in carried.values():
        runs: dict[tuple, list] = {}  # the blocks of the same sites, in window order
        for blk in blocks:
            runs.setdefault(blk[0], []).append(blk)
        for run in runs.values():
            first, k = run[0][1], len(run[0][0])
            steps = tuple(blk[4] for blk in run)
            n = sum(blk[3] for blk in run)
            a = torch.cat([blk[1][i][1] for i in range(k) for blk in run])
            d = torch.cat([blk[1][i][2] for i in range(k) for blk in run])
            at = (steps, d.dtype, d.device)
            s = scales[at] if at in scales else scales.setdefault(at, _per_sample(run, d))
            if s is not None:  # (cat made d: scaled in place)
                d.view(k, n, -1).mul_(s)
            site0, split0 = first[0][0], first[0][3]
            want = {"grad_sum": [attr for attr in site0.params if any(attr not in u[4] for u in first)] if totals else [],
                    "sum_grad_squared": list(site0.params) if squares else []}
            l2, got = site0.kernel.stacked_reduce(site0.module, a, d, k, [names for _, names in split0], want, acc)
            for q, by_attr in got.items():
                _add_stacked_sums(first, q, by_attr, acc[q], window.sum_blocks)
            into = parts.setdefault(steps, {})
            for j in range(len(split0)):  # the same attributes per group in every use
                groups = [u[3][j][0] for u in first]
                for part in l2[j]:
                    rows = part.view(k, n)
                    if len(set(groups)) == 1:
                        into.setdefault(groups[0], []).append(rows)
                    else:
                        for i, g in enumerate(groups):
                            into.setdefault(g, []).append(rows[i:i + 1])
    for steps, by_group in parts.items():
        sizes = [int(stats.batch_l2[i].shape[0]) for i in steps]
        total = None
        for g, rows in by_group.items():  # [k, n] blocks of uses: one sum over all of them
            v = (torch.cat(rows) if len(rows) > 1 else rows[0]).sum(0)
            total = v if total is None else total + v
            if g is not None:
                _add_pieces(stats.group_l2[g], steps, v.split(sizes))
        _add_pieces(stats.batch_l2, steps, total.split(sizes))


def _per_sample(run: list, like: Tensor) -> Tensor | None:
    """``[1, N, 1]`` per-sample scale of the micro-steps of ``run`` (``like``'s dtype and
    device), or None when it is 1 throughout."""
    scales = [blk[2] for blk in run]
    if not any(isinstance(c, Tensor) or c != 1.0 for c in scales):
        return None
    col = [torch.as_tensor(c, dtype=like.dtype, device=like.device).expand(blk[3]) for c, blk in zip(scales, run)]
    return (torch.cat(col) if len(col) > 1 else col[0]).view(1, -1, 1)


def _add_pieces(vectors: list, steps: tuple, pieces) -> None:
    """``vectors[i] += piece`` for the micro-steps ``steps`` (new tensors: the window's vectors
    may be shared)."""
    for i, piece in zip(steps, pieces):
        vectors[i] = vectors[i] + piece


def _add_stacked_sums(uses: list, quantity: str, got: dict[str, Tensor], acc: dict, blocks: dict) -> None:
    """Each stacked use's sum over its samples of ``quantity`` (``"grad_sum"``: sum_n g_n,
    ``"sum_grad_squared"``: sum_n g_n * g_n; ``got``: attribute -> ``[k, *param]``, per-sample
    units) into the window's ``acc``. A ``[k, *param]`` block becomes the uses' accumulators
    (row i is use i's; remembered in ``blocks``, the window's ``sum_blocks``); a later one for the same uses
    (the window settled before, e.g. for a checkpoint) is added onto it in one operation (if
    ``acc`` still holds those rows). A use's window gradient of an attribute that autograd's
    node hook delivers (its ``via``) is not added here."""
    for attr, g in got.items():
        skip = [quantity == "grad_sum" and attr in u[4] for u in uses]
        qs = tuple(u[0].params[attr] for u, s in zip(uses, skip) if not s)
        if len(qs) == len(uses):
            block = blocks.get((quantity, attr, qs))
            if block is not None and all(acc.get(q) is r for q, r in zip(qs, block[1])):
                block[0].add_(g)
                continue
        rows = g.unbind(0)
        if len(qs) == len(uses) and not any(q in acc for q in qs):
            if len(blocks) > 256:  # (stale entries fail the check above: dropping them is safe)
                blocks.clear()
            blocks[quantity, attr, qs] = (g, rows)
        dst, src = [], []
        for u, row, s in zip(uses, rows, skip):
            if s:
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
