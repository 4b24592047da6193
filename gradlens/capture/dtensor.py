"""Tensor parallelism in the capture: a layer whose parameters are ``DTensor`` shards
(``ColwiseParallel`` / ``RowwiseParallel`` of ``torch.distributed.tensor.parallel``).

Such a layer's forward runs on ``DTensor`` activations: its input is made with
``DTensor.from_local`` from a tensor the capture has marked (replicated for a column-wise layer,
sharded on its last dim for a row-wise one), its output is a ``DTensor`` whose local tensor the
next hook takes with ``to_local()``. The capture measures the layer on its *local* pieces, as a
Linear whose weight is this rank's shard: for a column-wise layer the local gradient of sample n
is ``delta_loc_n a_n^T`` (a replicated), for a row-wise one ``delta_n a_loc_n^T`` (delta
replicated); either is exactly this rank's block of sample n's full gradient, so per-sample sums
of squares add over the tensor-parallel ranks (gradlens/distributed/tensor_parallel.py). The
sample axis is never sharded (sequence parallelism, a shard of the batch dim, is refused).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from gradlens import compat
from gradlens.capture.events import Site
from gradlens.capture.marks import _batch_first

__all__ = ["is_dtensor", "local_site", "local_input", "local_grad", "tp_use"]

_NOTHING: frozenset = frozenset()

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without DTensor
    DTensor = None


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``DTensor``."""
    return DTensor is not None and isinstance(t, DTensor)


def _check_placements(t: Any, what: str, axis: int | None) -> None:
    """Only replicated pieces and shards of a feature dim (not the sample axis ``axis``)."""
    for pl in t.placements:
        if pl.is_replicate():
            continue
        if pl.is_shard():
            dim = pl.dim if pl.dim >= 0 else pl.dim + t.dim()
            if axis is None or dim != axis:
                continue
        raise RuntimeError(
            f"{what} is a DTensor with placements {tuple(t.placements)}: gradlens measures tensor "
            "parallelism whose activations are replicated or sharded on a feature dim "
            "(ColwiseParallel, RowwiseParallel); a sharded sample axis (sequence or context "
            "parallelism) or a partial sum is not supported: parallelize the layer with "
            "ColwiseParallel() / RowwiseParallel() (their default layouts), or leave it out with "
            "Lens(..., exclude=[...])"
        )


def local_site(site: Site) -> Site:
    """``site`` with a stand-in module whose parameters are this rank's local shards (plain
    tensors): a tensor-parallel ``nn.Linear``; any other layer with DTensor parameters is refused."""
    module = site.module
    if not isinstance(module, nn.Linear):
        raise RuntimeError(
            f"{site.name!r} ({type(module).__name__}) has DTensor parameters (tensor parallelism); "
            "gradlens measures tensor-parallel nn.Linear layers (ColwiseParallel, RowwiseParallel) "
            f"only: keep {site.name!r} replicated (leave it out of parallelize_module's plan) or "
            f"leave it out with Lens(..., exclude=[{site.name!r}])"
        )
    w, b = module.weight, module.bias
    proxy = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(proxy)
    lw = compat.dtensor_local(w) if is_dtensor(w) else w
    proxy.out_features, proxy.in_features = lw.shape
    proxy.weight = lw
    proxy.bias = None if b is None else (compat.dtensor_local(b) if is_dtensor(b) else b)
    return Site(site.name, proxy, site.kernel, site.params)


def local_input(a: Any, name: str, axis_of) -> tuple[Tensor, Any]:
    """The local tensor of a layer's DTensor input and its sample axis (``axis_of(local)``),
    its placements checked."""
    local = compat.dtensor_local(a)
    ax = axis_of(local)
    _check_placements(a, f"the input of {name!r}", ax[0] if type(ax) is tuple else None)
    return local, ax


def local_grad(g: Any, name: str, axis: int) -> Tensor:
    """The local tensor of a tensor-parallel layer's output gradient (a DTensor: replicated,
    or sharded on the output features); plain tensors pass through."""
    if not is_dtensor(g):
        return g
    _check_placements(g, f"the output gradient of {name!r}", axis)
    return compat.dtensor_local(g)


def tp_use(tap: Any, site: Site | None, module: nn.Module, a: Tensor, output: Tensor) -> None:
    """The Tap (``tap``) at a tensor-parallel layer call (its input a ``DTensor``): measured
    as a Linear on this rank's shards, its output and the output's local tensor marked with
    the input's sample axis; no routed or fused weight gradient, no stacking."""
    name = site.name if site is not None else type(module).__name__
    local, ax = local_input(a, name, tap.axis_of)
    out_local = compat.dtensor_local(output) if is_dtensor(output) else output
    keep = ax if type(ax) is tuple and output.dim() >= a.dim() else None
    tap._data[output] = keep
    tap._data[out_local] = keep
    if site is None or not output.requires_grad:
        return None
    what = f"the input of {name!r} ({type(module).__name__}, shape {tuple(a.shape)})"
    if type(ax) is not tuple or ax[1] != 1:
        tap._refuse_axis(output, what, site.params.values(), tap._lost.get(local),
                          detail=tap._why_unknown(local) if ax is None else " (not one row per sample)")
        return None
    psite = local_site(site)
    for q in site.params.values():
        tap.uses[q] = tap.uses.get(q, 0) + 1
    on_use, fid, batch, axis = tap.on_use, tap.forward_id, tap._batch, ax[0]
    last = site.kernel.rows_last
    a_b = _batch_first(local, axis, 1, batch, last) if axis else local

    def hook(g):
        g = local_grad(g, name, axis)
        return on_use(psite, a_b, _batch_first(g, axis, 1, batch, last) if axis else g, _NOTHING, batch, fid)

    with compat.no_torch_function():
        output.register_hook(hook)
    return None
