"""A Lens on a tensor-parallel model (``torch.distributed.tensor.parallel``: ``ColwiseParallel``,
``RowwiseParallel`` on a 1-D mesh), alone or inside FSDP2 over the data dim of a ``(dp, tp)``
mesh (the 2-D layout).

Every rank of a tensor-parallel (TP) group sees the same samples and holds a block of each
sharded parameter. The capture measures each tensor-parallel Linear on its local shards
(gradlens/capture/dtensor.py): sample n's local gradient is exactly this rank's block of its
full gradient, so

* per-sample sums of squares (``batch_l2 [N]``, the groups' ``[G, N]``) and the micro-steps'
  ``||s_k||^2`` are partial sums: they add over the TP group;
* ``sum_grad_squared`` and ``grad_sum`` of a sharded parameter are its blocks: each rank writes
  its block into a zeroed buffer of the full shape, and the sum over the TP group is the full
  tensor;
* a replicated parameter (a LayerNorm, a row-wise layer's bias, any plain parameter) has the
  same per-sample gradients on every TP rank: only TP rank 0 measures it (the others leave it
  out of every sum: :attr:`TPLayout.silent`), so it is counted once;
* N, K and the loss are the same on every TP rank and are not summed: the batch counts once.

When a tracked window closes, :meth:`TPLayout.fold` makes all of this one ``all_reduce`` over
the TP group (one flat buffer; see :func:`gradlens.distributed.merge.exchange`). Then, in the
2-D layout, the data-parallel merge runs over the data ranks only (the Lens's process group:
the data dim of the FSDP2 mesh), so N sums over data ranks only. An instrument whose rank merge
adds sums of disjoint entries (``tp_merges_by_sums``: GradHist1d's exact counts, its extremes
shared) rides in the same all_reduce; the others that keep per-sample vectors, factors or
parameter-value states of their own are refused under tensor parallelism
(:func:`gradlens.lens.checks.check_tp_instruments`), naming each.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
from torch import Tensor

from gradlens import compat
from gradlens.core.param_shapes import full_shape
from gradlens.core.stats import Accumulators, DistParts
from gradlens.core.window import Window

__all__ = ["TPLayout", "TP_QUANTITIES"]

#: what a window carries that the TP fold combines exactly
TP_QUANTITIES = frozenset({"batch_l2", "sum_grad_squared", "grad_sum", "micro_grad_sq"})


def _is_dtensor(p: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return False
    return isinstance(p, DTensor)


@dataclasses.dataclass
class _Slot:
    """Where a tracked parameter's local block sits in its full shape: ``dim`` None for a
    replicated parameter, else the sharded dim, the block's ``start`` and ``length`` on it."""

    dim: int | None
    start: int = 0
    length: int = 0


class TPLayout:
    """The tensor-parallel layout of a Lens's tracked parameters (module docstring).

    Attributes:
        group: the TP process group (the DTensor parameters' 1-D mesh).
        rank, world: this rank's index in it, its size.
        slots: qualified name -> :class:`_Slot` of every tracked parameter.
        silent: the replicated parameters this rank leaves out of every sum (all of them on TP
            ranks other than 0; none on rank 0).
        data_group: the data-parallel group of the 2-D layout (the FSDP2 mesh's data dim), None
            for tensor parallelism alone.
    """

    def __init__(self, mesh: Any, slots: dict[str, _Slot], data_group: Any):
        self.mesh = mesh
        self.group = mesh.get_group()
        self.rank = mesh.get_local_rank()
        self.world = mesh.size()
        self.slots = slots
        self.silent = frozenset(q for q, s in slots.items() if s.dim is None) if self.rank else frozenset()
        self.data_group = data_group

    @classmethod
    def of(cls, model: Any, params: dict[str, Any]) -> "TPLayout | None":
        """The layout of ``params`` (the Lens's tracked parameters: under FSDP2 the unsharded
        ones), or None when none is a DTensor. Refused: DTensors on several meshes, on a mesh of
        more than one dim, or with placements other than one Shard or Replicate."""
        dts = {q: p for q, p in params.items() if _is_dtensor(p)}
        if not dts:
            return None
        meshes: list = []  # (DeviceMesh objects of one mesh compare equal, not always identical)
        for p in dts.values():
            if not any(p.device_mesh == m for m in meshes):
                meshes.append(p.device_mesh)
        mesh = meshes[0]
        if len(meshes) > 1 or mesh.ndim != 1:
            raise RuntimeError(
                "the model's DTensor parameters lie on "
                + (f"{len(meshes)} device meshes" if len(meshes) > 1 else f"a {mesh.ndim}-D mesh")
                + ": gradlens supports tensor parallelism on one 1-D mesh (parallelize_module(model, "
                "tp_mesh, plan)), optionally inside FSDP2 over the data dim of a (dp, tp) mesh "
                "(fully_shard(model, mesh=mesh_2d['dp']))"
            )
        world, rank = mesh.size(), mesh.get_local_rank()
        slots = {}
        for q, p in params.items():
            if not _is_dtensor(p) or all(pl.is_replicate() for pl in p.placements):
                slots[q] = _Slot(None)
                continue
            pl = p.placements[0]
            if not pl.is_shard():
                raise RuntimeError(
                    f"parameter {q!r} is a DTensor with placement {pl}: gradlens supports "
                    "parameters sharded on one dim (Shard) or replicated under tensor parallelism"
                )
            shape = full_shape(p)
            dim = pl.dim if pl.dim >= 0 else pl.dim + len(shape)
            chunk = -(-shape[dim] // world)  # torch.chunk's blocks, as DTensor shards
            start = min(rank * chunk, shape[dim])
            length = compat.dtensor_local(p).shape[dim]
            if length != max(0, min(chunk, shape[dim] - start)):
                raise RuntimeError(
                    f"parameter {q!r}'s local shard ({length} of {shape[dim]} on dim {dim}) is not "
                    "DTensor's even split: gradlens supports Shard placements as parallelize_module makes them"
                )
            slots[q] = _Slot(dim, start, length)
        return cls(mesh, slots, _data_group(model, mesh))

    # ---- the window ---------------------------------------------------------------------
    def fold(self, whole: Window, needs: frozenset, params: dict[str, Any], groups: tuple,
             timeout: float | None, instruments: Sequence[Any] = ()) -> Window:
        """The window of the full model on this TP group's samples: one all_reduce over the TP
        group (module docstring), which also carries the states of the ``instruments`` whose
        rank merge adds sums over disjoint parameter blocks (``tp_merges_by_sums``: GradHist1d's
        counts and extremes). Every TP rank calls it for the same windows."""
        from gradlens.distributed.merge import MergeContext, exchange

        stats = whole.stats
        f64 = torch.float64
        sums: list[Tensor] = [stats.micro_grad_sq.double().reshape(1)]
        n = sum(t.numel() for t in stats.batch_l2)
        has_l2 = bool(stats.batch_l2)
        if has_l2:
            sums.append(stats.batch_l2_all().double())
            for g in groups:
                parts = stats.group_l2.get(g)
                sums.append(torch.cat(parts).double() if parts else torch.zeros(n, dtype=f64))
        quantities = [(k, getattr(stats, k)) for k in ("sum_grad_squared", "grad_sum") if k in needs]
        for _, acc in quantities:
            for q, p in params.items():
                sums.append(self._full(q, p, acc.get(q)))
        what = "the tensor-parallel fold of a window"
        ctx = MergeContext(params, [], needs, world=self.world, rank=self.rank, timeout=timeout, groups=groups)
        by_sums = [i for i in instruments if getattr(i, "tp_merges_by_sums", False)]
        parts = [DistParts(sums=sums)] + [i.to_buffers(whole.states[id(i)], ctx) for i in by_sums]
        merged_parts = exchange(parts, self.group, timeout=timeout, what=what)
        got = merged_parts[0][0]
        states = dict(whole.states)
        for inst, g in zip(by_sums, merged_parts[1:]):
            states[id(inst)] = inst.from_buffers(whole.states[id(inst)], ctx, *g)
        out = dataclasses.replace(stats, micro_grad_sq=got[0].reshape(()))
        i = 1
        if has_l2:
            sizes = [t.numel() for t in stats.batch_l2]
            out.batch_l2 = list(got[i].split(sizes))
            i += 1
            if groups:
                out.group_l2 = {g: list(got[i + j].split(sizes)) for j, g in enumerate(groups)}
                i += len(groups)
        for key, acc in quantities:
            merged = Accumulators(getattr(acc, "pool", None))
            for q in params:
                merged[q] = got[i]
                i += 1
            setattr(out, key, merged)
        out.__dict__.pop("_memo", None)
        return whole.merged(out, states)

    def _full(self, q: str, p: Any, local: Tensor | None) -> Tensor:
        """``[*full shape]`` zeros with this rank's block of ``q`` written in (nothing for a
        parameter this rank leaves out)."""
        dtype = local.dtype if local is not None else torch.promote_types(p.dtype, torch.float32)
        full = torch.zeros(tuple(full_shape(p)), dtype=dtype, device=compat.dtensor_local(p).device
                           if _is_dtensor(p) else p.device)
        if local is None or q in self.silent:
            return full
        slot = self.slots[q]
        if slot.dim is None:
            full.copy_(local)
        else:
            full.narrow(slot.dim, slot.start, slot.length).copy_(local)
        return full


def _data_group(model: Any, tp_mesh: Any) -> Any:
    """The data-parallel group of the 2-D layout: the first dim of the FSDP2 mesh whose other
    dim is the TP mesh; None without FSDP2 (tensor parallelism alone)."""
    for fp in compat.fsdp_params(model).values():
        mesh = fp.sharded_param.device_mesh
        if mesh.ndim == 2:
            return mesh.get_group(0)
    return None

