"""A tracked parameter's shape as the model defines it, whatever its data holds now.

DeepSpeed ZeRO stage 3 partitions each parameter across the data-parallel ranks: outside its
module's forward and backward, the ``nn.Parameter`` (the same object the model holds) has an
empty ``[0]`` tensor as its data, and DeepSpeed keeps the model's shape in the attribute
``ds_shape`` (``ds_numel`` its element count). What gradlens sizes from a tracked parameter after
backward (zeros for a parameter no use reached, the buffers of the rank merge, the coverage)
reads it through these two functions; for any other parameter they are ``p.shape`` and
``p.numel()``. Told by the attribute, without importing DeepSpeed.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["full_shape", "full_numel", "local_numel", "tracked_fraction"]


def full_shape(p: Any) -> torch.Size:
    """``p``'s shape in the model: ``ds_shape`` for a ZeRO-3 parameter, else ``p.shape``."""
    shape = getattr(p, "ds_shape", None)
    return torch.Size(shape) if shape is not None else p.shape


def full_numel(p: Any) -> int:
    """``p``'s number of elements in the model: ``ds_numel`` for a ZeRO-3 parameter, else
    ``p.numel()``."""
    n = getattr(p, "ds_numel", None)
    return int(n) if n is not None else p.numel()


def local_numel(p: Any) -> int:
    """Elements of this rank's block of ``p``: a tensor-parallel ``DTensor``'s local shard,
    else :func:`full_numel`."""
    from gradlens import compat

    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return full_numel(p)
    return compat.dtensor_local(p).numel() if isinstance(p, DTensor) else full_numel(p)


def tracked_fraction(params: dict, model: Any) -> float:
    """The fraction of ``model``'s trainable elements (full shapes) that ``params`` hold."""
    total = sum(full_numel(p) for p in model.parameters() if p.requires_grad)
    return sum(full_numel(p) for p in params.values()) / max(total, 1)
