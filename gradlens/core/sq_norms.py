"""Squared norms of gradients as 0-d float64 tensors, without host syncs (a leaf module: the
noise-scale instruments, the DDP gradient route and the Lens share it)."""

from __future__ import annotations

import torch
from torch import Tensor
from gradlens.core.limits import SMALL_DOT as _SMALL

__all__ = ["sq_norm", "sum_sq"]




def sum_sq(grads: list[Tensor | None]) -> Tensor | None:
    """sum of ||g||^2 over the gradients given (None entries skipped) as a 0-d float64 tensor, or
    None if there is none; no host sync. Dense float32/float64 tensors cost one dot product each
    (BLAS accumulation: about 25x more accurate in float32 than ``torch._foreach_norm``) and one
    stack and sum for all, not a few small ops per tensor, which dominate for models of many
    small parameters."""
    fast: list[Tensor] = []
    total = None
    for g in grads:
        if g is None:
            continue
        if g.is_sparse or g.dtype not in (torch.float32, torch.float64):
            term = sq_norm(g)
            total = term if total is None else total + term
        else:
            fast.append(g.detach().reshape(-1))
    if fast:
        big = [v for v in fast if v.numel() > _SMALL]
        small: dict[torch.dtype, list[Tensor]] = {}
        for v in fast:
            if v.numel() <= _SMALL:
                small.setdefault(v.dtype, []).append(v)
        # small tensors (biases, norms' scales) are joined: one copy of a few numbers, one dot
        big += [torch.cat(vs) if len(vs) > 1 else vs[0] for vs in small.values()]
        dots = [torch.dot(v, v) for v in big]
        if all(d.dtype == dots[0].dtype for d in dots):
            term = torch.stack(dots).double().sum()
        else:
            term = torch.stack([d.double() for d in dots]).sum()
        total = term if total is None else total + term
    return total


def sq_norm(grad: Tensor) -> Tensor:
    """||grad||^2 as a 0-d float64 tensor (sparse gradients: their values; no host sync)."""
    g = grad.detach()
    if g.is_sparse:
        g = g.coalesce().values()
    if g.dtype not in (torch.float32, torch.float64):
        g = g.float()
    g = g.reshape(-1)
    return torch.dot(g, g).double()
