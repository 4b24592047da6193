"""One pass over a use's materialised per-sample gradients ``[b, *param]``, chunk by chunk.

Where a use's per-sample gradients must be formed (histograms of layers without rank-one
factors, the sums of layers without a factor formula), :func:`measure` forms them one chunk of
samples at a time (at most ``Meter.chunk_elements`` elements, :func:`gradlens.kernels.sample_chunks`)
and hands each chunk to every per-sample instrument that still needs it; the same chunk's
squares give the norms and the sum of squares, its sum the window gradient and a fused Linear
call's dL/dW (:class:`gradlens.capture.events.WeightGrad`). Memory stays at one chunk. On the CPU a
chunk holds at most :data:`CPU_SLICE_ELEMENTS` (less where ``chunk_elements`` says so): the
passes over it (binning, squares, sums) then read it from the cache, not from memory.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gradlens.capture.events import Site
from gradlens.kernels.base import add_into, sample_chunks, zeros_into
from gradlens.capture.units import MicroStep
from gradlens.core.limits import CPU_SLICE_ELEMENTS
from gradlens.core.param_shapes import full_numel, full_shape

__all__ = ["CPU_SLICE_ELEMENTS", "measure"]



def measure(meter, w: Site, a: Tensor, delta: Tensor, micro: MicroStep, attrs: list[str], done: set,
            from_chunks: frozenset, weight_via_node, weight_grad) -> None:
    """The materialising pass of one use for ``meter`` (the :class:`gradlens.measure.meter.Meter`,
    whose plan, tracked parameters and chunk bound it reads): the sums go into the window's
    statistics (``meter.window.stats``), the norms into the micro-step ``micro``;
    ``attrs`` the attributes to form, ``done`` the ``(id(instrument), attr)`` pairs already
    served (factors, sampled entries), ``from_chunks`` the sums to take from the chunks,
    ``weight_via_node`` the attributes whose window gradient autograd delivers, ``weight_grad``
    ``(slot, per-sample scale)`` of a fused Linear call (its dL/dW, if not yet formed, is the
    sum of the chunks' weight slices over the scale)."""
    kernel, module, stats = w.kernel, w.module, meter.window.stats
    numel = sum(full_numel(getattr(module, attr)) for attr in attrs)
    l2_parts = []
    of = meter.group_of
    # per group (Lens(groups=...)): this use's chunks of ||g_n||^2 over the group's parameters
    group_parts: dict[str, list] = {}
    # a fused Linear call not yet given its dL/dW: the sum of the slices formed here
    fill = weight_grad is not None and weight_grad[0].value is None and "weight" in attrs
    wsum = delta.new_zeros(full_shape(module.weight)) if fill else None
    budget = meter.chunk_elements if delta.device.type != "cpu" else min(meter.chunk_elements, CPU_SLICE_ELEMENTS)
    for s, e in sample_chunks(numel, delta.shape[0], budget):
        chunk = kernel.per_sample(module, a, delta, s, e, attrs=attrs)
        l2 = 0
        if wsum is not None:
            wsum.view(1, -1).addmm_(delta.new_ones(1, e - s), chunk["weight"].reshape(e - s, -1))
        for attr in attrs:
            gb = chunk[attr]
            qname = w.params[attr]
            param = meter.tap.params[qname]
            for inst in meter.plan.per_sample:
                if (id(inst), attr) not in done:
                    inst.update(micro.states[id(inst)], qname, param, gb)
            total = "grad_sum" in from_chunks and attr not in weight_via_node  # else from autograd
            single = e - s == 1 and gb.numel() > CPU_SLICE_ELEMENTS  # one large sample: its sums in place
            if single:
                part = _one_sample(gb, qname, stats, from_chunks, total)
            else:
                sq = gb.square() if from_chunks & {"batch_l2", "sum_grad_squared"} else None  # once
                part = sq.reshape(sq.shape[0], -1).sum(1) if "batch_l2" in from_chunks else None
            if part is not None:
                l2 = l2 + part
                if of:
                    chunks = group_parts.setdefault(of[qname], [])
                    if len(chunks) > len(l2_parts):  # a second parameter of the same group
                        chunks[-1] = chunks[-1] + part
                    else:
                        chunks.append(part)
            if single:
                continue
            if "sum_grad_squared" in from_chunks:
                add_into(stats.sum_grad_squared, qname, sq.sum(0))
            if total:
                add_into(stats.grad_sum, qname, gb.sum(0))
        if "batch_l2" in from_chunks:
            l2_parts.append(l2)
    if l2_parts:
        micro.add_l2(torch.cat(l2_parts) if len(l2_parts) > 1 else l2_parts[0])
        for group, chunks in group_parts.items():
            micro.add_group_l2(torch.cat(chunks), group)
    if wsum is not None:
        holder, scale = weight_grad
        holder.value = (wsum / scale).to(module.weight.dtype)



def _one_sample(g: Tensor, qname: str, stats, from_chunks: frozenset, total: bool) -> Tensor | None:
    """The sums of one sample's gradient ``g [1, *param]`` added in place into the window's
    accumulators (no temporary of the parameter's size); returns its ``[1]`` ||g_n||^2 where
    ``"batch_l2"`` is in ``from_chunks``, else None. ``total``: add g_n into ``grad_sum`` too."""
    flat = g.reshape(-1)
    shape = tuple(g.shape[1:])
    if "sum_grad_squared" in from_chunks:
        zeros_into(stats.sum_grad_squared, qname, shape, g).view(-1).addcmul_(flat, flat)
    if "grad_sum" in from_chunks and total:
        zeros_into(stats.grad_sum, qname, shape, g).view(-1).add_(flat)
    return torch.dot(flat, flat).reshape(1) if "batch_l2" in from_chunks else None
