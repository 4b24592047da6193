"""Layouts of the batch that gradlens does not measure, refused at the tracked forward that
meets them: sequence parallelism (activations sharded along the sequence dim across ranks:
``SequenceParallel`` in a tensor-parallel plan, a ``DTensor`` input placed ``Shard(d)`` on a
middle dim) and context parallelism (``context_parallel(...)``: the batch's sequence dim
sharded in place, attention run as a ring across ranks). A sample's gradient then sums over
positions held by other ranks, which no rank sees.

What is detected (docs/distributed.md, "What is refused"): a ``DTensor`` that is the model's
input or a measured layer's input with a ``Shard(d)`` placement for ``0 < d < ndim - 1`` (a
``Shard`` of the last dim is tensor parallelism's feature split, of dim 0 the samples'), and an
active ``context_parallel`` in its default (monkey-patching) mode, a module of the model
wrapped with context parallelism's module-wrapper style (``_ContextParallel``), and expert parallelism: an
``all_to_all`` exchange called inside a tracked forward (``torch.distributed.all_to_all[_single]``,
its autograd form in ``torch.distributed.nn.functional``, the functional collectives'
``all_to_all_single[_autograd]``), which moves tokens of one rank's samples to experts held by
another rank. Not detected: an exchange run by a custom kernel that no torch call wraps.
"""

from __future__ import annotations

from typing import Any

from gradlens import compat

__all__ = ["check_batch_layout", "is_exchange", "refuse_context_parallel", "refuse_exchange", "SUPPORTED_LAYOUTS"]

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


def refuse_context_parallel(where: str) -> None:
    """Refuse context parallelism met at ``where``: a RuntimeError naming what works."""
    raise RuntimeError(
        f"gradlens: a tracked forward ({where}) runs under context parallelism "
        "(context_parallel(...), or an attention module wrapped with _ContextParallel), whose "
        "ranks hold different positions of each sample's sequence, so no rank has a "
        "sample's gradient; context parallelism is not supported (yet). Supported across "
        f"ranks: {SUPPORTED_LAYOUTS}; or leave this window untracked"
    )


def check_batch_layout(tensors, where: str) -> None:
    """Refuse sequence / context parallel layouts (module docstring) among ``tensors`` (the
    inputs of the model or of a measured layer ``where``): a RuntimeError naming what works."""
    if compat.context_parallel_active():
        refuse_context_parallel(where)
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


#: the collectives that move a tensor's rows between ranks (expert parallelism's dispatch)
_EXCHANGES = frozenset({"all_to_all", "all_to_all_single", "all_to_all_single_autograd"})


def is_exchange(func) -> bool:
    """Whether the torch call ``func`` seen by the capture is an ``all_to_all`` collective (of
    ``torch.distributed`` or its functional / autograd forms)."""
    name = getattr(func, "__name__", "").split(".")[0]  # an OpOverload: "all_to_all_single.default"
    if name not in _EXCHANGES:
        return False
    module = str(getattr(func, "__module__", "") or "")
    return "distributed" in module or "c10d" in module


def refuse_exchange(func, where: str) -> None:
    """Refuse expert parallelism: an ``all_to_all`` inside a tracked forward (a RuntimeError
    naming what works)."""
    raise RuntimeError(
        f"gradlens: a tracked forward ({where}) calls {getattr(func, '__module__', '')}."
        f"{getattr(func, '__name__', func)}, an all_to_all exchange between ranks: expert "
        "parallelism moves tokens of one rank's samples to experts on other ranks, so no rank "
        "holds a sample's gradient of those experts; it is not supported (yet). Supported across "
        f"ranks: {SUPPORTED_LAYOUTS}. To measure the model, keep every expert on each rank "
        "(data parallel or FSDP2 over the whole model)"
    )
