"""Layouts of the batch that gradlens does not measure, refused at the tracked forward that
meets them: sequence parallelism (activations sharded along the sequence dim across ranks:
``SequenceParallel`` in a tensor-parallel plan, a ``DTensor`` input placed ``Shard(d)`` on a
middle dim) and context parallelism (``context_parallel(...)``: the batch's sequence dim
sharded in place, attention run as a ring across ranks). A sample's gradient then sums over
positions held by other ranks, which no rank sees.

What is detected (docs/distributed.md, "What is refused"): a ``DTensor`` that is the model's
input or a measured layer's input with a ``Shard(d)`` placement for ``0 < d < ndim - 1`` (a
``Shard`` of the last dim is tensor parallelism's feature split, of dim 0 the samples'), and an
active ``context_parallel`` in its default (monkey-patching) mode. Not detected: expert
parallelism whose tokens travel between ranks in ``all_to_all`` calls inside the forward.
"""

from __future__ import annotations

from typing import Any

from gradlens import compat

__all__ = ["check_batch_layout", "SUPPORTED_LAYOUTS"]

#: what gradlens measures across ranks (named by the refusals)
SUPPORTED_LAYOUTS = (
    "data parallelism (DistributedDataParallel), FSDP2 (fully_shard), DeepSpeed ZeRO, and "
    "pipelines (ScheduleGPipe / Schedule1F1B, a Lens per stage)"
)


def _sequence_dim(x: Any) -> int | None:
    """The middle dim a DTensor is sharded on (None: not a DTensor, or not such a shard)."""
    if not compat.is_dtensor(x):
        return None
    for placement in x.placements:
        dim = getattr(placement, "dim", None)
        if placement.is_shard() and dim is not None:
            d = dim % x.dim()
            if 0 < d < x.dim() - 1:
                return d
    return None


def check_batch_layout(tensors, where: str) -> None:
    """Refuse sequence / context parallel layouts (module docstring) among ``tensors`` (the
    inputs of the model or of a measured layer ``where``): a RuntimeError naming what works."""
    if compat.context_parallel_active():
        raise RuntimeError(
            f"gradlens: a tracked forward ({where}) runs under context_parallel(...), whose "
            "ranks hold different positions of each sample's sequence, so no rank has a "
            "sample's gradient; context parallelism is not supported (yet). Supported across "
            f"ranks: {SUPPORTED_LAYOUTS}; or leave this window untracked"
        )
    for x in tensors:
        d = _sequence_dim(x)
        if d is not None:
            raise RuntimeError(
                f"gradlens: the input of {where} is a DTensor sharded along dim {d} "
                f"({tuple(x.placements)}, shape {tuple(x.shape)}): sequence parallelism "
                "(SequenceParallel, a Shard on the sequence dim) splits each sample's positions "
                "across ranks, so no rank has a sample's gradient; it is not supported (yet). "
                f"Supported across ranks: {SUPPORTED_LAYOUTS}"
            )
