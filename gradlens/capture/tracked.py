"""Which parameters of a model are tracked: what marks a model for gradlens (``extend``: its
exclusions, its inputs' sample axis) or a loss module (its forward hook reports each loss)."""

from __future__ import annotations

from typing import Iterable

from torch import nn

from gradlens import compat
from gradlens.core.param_shapes import full_numel
from gradlens.capture.losses import _loss_forward_hook

__all__ = ["extend", "declared_batch_dim", "is_extended", "model_exclusions", "tracked_parameters", "trainable_split"]

_EXTENDED = "_gradlens_extended"
_EXCLUDE = "_gradlens_exclude"
_LOSS_HOOK = "_gradlens_loss_hook"
_BATCH_DIM = "_gradlens_batch_dim"


def _is_loss(module: nn.Module) -> bool:
    return isinstance(module, compat.LossBase)


def extend(module: nn.Module, exclude: Iterable[str] = (), batch_dim: int | None = None) -> nn.Module:
    """Make ``module`` ready for gradlens and check it; returns the same module.

    For a loss module (``nn.CrossEntropyLoss``, ``nn.MSELoss``, ...): installs a light forward
    hook that tells :meth:`gradlens.Lens.capture` the reduction and batch size of the loss.

    For a model: marks it and remembers ``exclude``; every trainable parameter not excluded is
    tracked by each :class:`~gradlens.Lens` on it (see :mod:`gradlens.capture.registry` for how each
    layer is handled). No hook is left on the model: the Lens installs its hooks for tracked
    windows only.

    Args:
        module: a model or a loss module.
        exclude: parameter names (``"fc.weight"``, ``"cls_token"``) or module names (``"fc"``,
            ``"encoder.norm"``) whose parameters gradlens must not track.
        batch_dim: the sample axis of the model's inputs (``1`` for sequence-first ``[T, B]``
            inputs); default: 0, or 1 where the model itself says ``batch_first=False``. From
            there the axis is followed through the forward, never guessed from sizes.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"extend() takes an nn.Module, got {type(module).__name__}")
    if _is_loss(module):
        if module.reduction not in ("mean", "sum"):
            raise ValueError(
                f"{type(module).__name__}(reduction={module.reduction!r}) is not supported: "
                "use reduction='mean' or 'sum' (per-sample losses for Alpha go to "
                "lens.capture(losses=...))"
            )
        if not hasattr(module, _LOSS_HOOK):
            setattr(module, _LOSS_HOOK, module.register_forward_hook(_loss_forward_hook))
        return module
    if isinstance(exclude, str):
        raise TypeError(f"exclude must be a list of names, got the string {exclude!r}; use exclude=[{exclude!r}]")
    if batch_dim is not None:
        if isinstance(batch_dim, bool) or not isinstance(batch_dim, int) or batch_dim < 0:
            raise ValueError(
                f"batch_dim must be a non-negative int (the inputs' sample axis), got {batch_dim!r}; "
                "e.g. gradlens.extend(model, batch_dim=1) for [T, B] inputs"
            )
        setattr(module, _BATCH_DIM, batch_dim)
    exclude = tuple(getattr(module, _EXCLUDE, ())) + tuple(exclude)
    tracked_parameters(module, exclude)  # checks the names
    setattr(module, _EXCLUDE, exclude)
    setattr(module, _EXTENDED, True)
    return module


def declared_batch_dim(module: nn.Module) -> int | None:
    """The inputs' sample axis given to :func:`extend` (``batch_dim=``), else None."""
    return getattr(module, _BATCH_DIM, None)


def is_extended(module: nn.Module) -> bool:
    return bool(getattr(module, _EXTENDED, False))


def model_exclusions(module: nn.Module) -> tuple[str, ...]:
    return tuple(getattr(module, _EXCLUDE, ()))


def _excluded(name: str, exclude: tuple[str, ...]) -> bool:
    return any(name == e or name.startswith(e + ".") for e in exclude if e)


def tracked_parameters(model: nn.Module, exclude: tuple[str, ...] = ()) -> dict[str, nn.Parameter]:
    """Qualified name -> parameter for every trainable parameter of ``model`` not excluded (a
    shared parameter once, under its first name in ``named_parameters()``).

    Raises:
        ValueError: a name in ``exclude`` matches no parameter or module of ``model``.
    """
    if any(exclude):
        names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        names |= {n for n, _ in model.named_modules(remove_duplicate=False) if n}
        for e in exclude:
            if e and not any(n == e or n.startswith(e + ".") for n in names):
                raise ValueError(
                    f"exclude names {e!r}, which is neither a parameter nor a module of "
                    f"{type(model).__name__}; names are as in model.named_parameters() "
                    "(e.g. 'encoder.norm.weight') or model.named_modules() (e.g. 'encoder.norm')"
                )
    return trainable_split(model, exclude)[0]


def trainable_split(model: nn.Module, exclude: tuple[str, ...] = ()) -> tuple[dict[str, nn.Parameter], int]:
    """(the parameters :func:`tracked_parameters` returns, without checking ``exclude``; the
    number of trainable elements of ``model``, excluded ones included), in one walk."""
    params, total = {}, 0
    for n, p in compat.named_parameters(model):
        if p.requires_grad:
            total += full_numel(p)
            if not exclude or not _excluded(n, exclude):
                params[n] = p
    return params, total
