"""Adaptive gradient clipping (AGC, Brock et al. 2021, "High-Performance Large-Scale Image
Recognition Without Normalization", arXiv:2102.06171).

For every output unit i of a parameter W (a row of a Linear weight, a filter of a Conv weight),
with G the gradient:

    G_i <- G_i * min(1, clip_factor * max(||W_i||, eps) / ||G_i||)

computed with a clamped coefficient (no Python branching on data, no device sync). Applied to
an accumulated gradient, clip once per window, on the unscaled window gradient: clipping is
nonlinear, so clipping each micro-step and summing gives a different (wrong) result.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Union

import torch
from torch import Tensor, nn

from gradlens import compat

__all__ = ["compute_norm", "unitwise_norm", "adaptive_clip_grad", "adaptive_clip_grad_"]

Dim = Union[int, Sequence[int], None]
ParamsArg = Union[nn.Module, Iterable[Tensor], Iterable[tuple[str, Tensor]]]


def compute_norm(x: Tensor, dim: Dim = None, keepdim: bool = False) -> Tensor:
    """The L2 norm of ``x`` over ``dim`` (all dims when None).

    Computed in at least float32 (bf16/fp16 inputs are upcast), returned in that dtype.

    Args:
        x: any tensor ``[*shape]``.
        dim: the dimension(s) to reduce over, or None for all.
        keepdim: keep reduced dims with size 1 (so the result broadcasts against ``x``).
    """
    dtype = torch.promote_types(x.dtype, torch.float32)
    return torch.linalg.vector_norm(x, 2, dim=dim, keepdim=keepdim, dtype=dtype)


def unitwise_norm(x: Tensor, dim: Dim = None) -> Tensor:
    """Norm per output unit, shaped to broadcast against ``x``.

    PyTorch layouts: a Linear weight ``[out, in]`` or Conv weight ``[out, in/groups, *kernel]``
    has its output unit on dim 0, so the norm is over every dim but 0 (result ``[out, 1, ...]``);
    a vector (bias, gain) or scalar is one unit (norm of the whole tensor, result ``[1]`` or
    ``[]``). ConvTranspose weights ``[in, out/groups, *kernel]`` have their output unit on dim 1:
    pass ``dim=(0, 2, 3, ...)`` (the dims to reduce); with ``groups > 1`` that pools the groups
    sharing an index on dim 1.

    Args:
        x: a parameter or its gradient.
        dim: dims to reduce over, overriding the layout rule above.

    Returns:
        ``[*keepdim shape]`` in at least float32.
    """
    if dim is None:
        if x.dim() <= 1:
            return compute_norm(x, None, keepdim=True)
        dim = tuple(range(1, x.dim()))
    else:
        _check_dim(dim, max(x.dim(), 1), "unitwise_norm(dim=...)")
    return compute_norm(x, dim, keepdim=True)


def _named(parameters: ParamsArg) -> tuple[list[tuple[str | None, Tensor]], dict[str, Dim]]:
    """Parameters as (name or None, tensor) pairs, plus layout dims found from a module."""
    auto_dims: dict[str, Dim] = {}
    if isinstance(parameters, nn.Module):
        for mod_name, module in parameters.named_modules():
            if isinstance(module, compat.ConvTransposeBase):
                w = module.weight
                auto_dims[f"{mod_name}.weight" if mod_name else "weight"] = (0,) + tuple(
                    range(2, w.dim())
                )
        return list(parameters.named_parameters()), auto_dims
    if isinstance(parameters, Tensor):
        return [(None, parameters)], auto_dims
    if isinstance(parameters, (str, bytes)) or not isinstance(parameters, Iterable):
        raise TypeError(
            f"parameters must be the model, model.named_parameters(), model.parameters() or a "
            f"tensor, got {parameters!r}; e.g. adaptive_clip_grad_(model, clip_factor=0.01)"
        )
    out: list[tuple[str | None, Tensor]] = []
    for i, item in enumerate(parameters):
        if isinstance(item, Tensor):
            out.append((None, item))
        elif (
            isinstance(item, tuple)
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], Tensor)
        ):
            out.append(item)
        else:
            raise TypeError(
                f"parameters[{i}] must be a tensor or a (name, tensor) pair as given by "
                f"model.named_parameters(), got {type(item).__name__}."
            )
    kinds = {name is None for name, _ in out}
    if len(kinds) > 1:
        raise TypeError(
            "parameters mixes tensors and (name, tensor) pairs; pass model.named_parameters() "
            "or model.parameters(), not both."
        )
    return out, auto_dims


def _check_args(clip_factor: float, eps: float) -> None:
    for name, value in (("clip_factor", clip_factor), ("eps", eps)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
            raise ValueError(
                f"{name} must be a positive number, got {value!r}; the paper uses "
                f"clip_factor=0.01 (batch 4096, 0.02 at smaller batches) and eps=1e-3."
            )


def _resolve(
    parameters: ParamsArg, exclude: Iterable[str], dims: Mapping[str, Dim] | None
) -> tuple[list[tuple[str | None, Tensor]], set[str], dict[str, Dim]]:
    named, auto_dims = _named(parameters)
    if dims is not None and not isinstance(dims, Mapping):
        raise TypeError(
            f"dims must map parameter names to the dims to reduce, got {dims!r}; e.g. "
            "dims={'deconv.weight': (0, 2, 3)}"
        )
    excluded = {exclude} if isinstance(exclude, str) else set(exclude)
    overrides = dict(auto_dims)
    overrides.update(dims or {})
    if excluded or dims:
        if any(name is None for name, _ in named):
            raise TypeError(
                "exclude= and dims= select parameters by name, but parameters has no names; pass "
                "model.named_parameters() or the model itself."
            )
        names = {name for name, _ in named}
        unknown = sorted((excluded | set(dims or {})) - names)
        if unknown:
            raise ValueError(
                f"exclude/dims name parameters {unknown} that are not among the parameters given; "
                f"use names from model.named_parameters(), e.g. {sorted(names)[:4]}."
            )
        shapes = dict(named)
        for name, dim in (dims or {}).items():
            _check_dim(dim, max(shapes[name].dim(), 1), f"dims[{name!r}]")
    return named, excluded, overrides


def _check_dim(dim: Dim, ndim: int, what: str) -> None:
    """Refuse dims that are not ints in ``[-ndim, ndim)`` (torch's rule), naming ``what``."""
    if dim is None:
        return
    items = (dim,) if isinstance(dim, int) else dim
    try:
        items = tuple(items)
    except TypeError:
        items = (dim,)
    bad = [d for d in items if isinstance(d, bool) or not isinstance(d, int) or not -ndim <= d < ndim]
    if bad:
        raise ValueError(
            f"{what}={dim!r} is out of range for a tensor of {ndim} dim(s); give the dims to "
            f"reduce as ints in [-{ndim}, {ndim - 1}], e.g. {tuple(range(1, ndim)) or None!r} "
            "(every dim but the output unit's)"
        )


def _clip_one(w: Tensor, g: Tensor, clip_factor: float, eps: float, dim: Dim) -> Tensor:
    """``g * min(1, clip_factor * max(||w||_unit, eps) / ||g||_unit)`` as a clamped coefficient."""
    max_norm = unitwise_norm(w.detach(), dim).clamp(min=eps).mul(clip_factor)
    g_norm = unitwise_norm(g, dim)
    # max_norm > 0, so max_norm / max(g_norm, max_norm) = min(1, max_norm / g_norm) without inf.
    coef = max_norm / torch.maximum(g_norm, max_norm)
    return coef.to(g.dtype)


def adaptive_clip_grad(
    parameters: ParamsArg,
    gradients: Sequence[Tensor | None] | None = None,
    clip_factor: float = 0.01,
    eps: float = 1e-3,
    *,
    exclude: Iterable[str] = (),
    dims: Mapping[str, Dim] | None = None,
) -> list[Tensor | None]:
    """Unit-wise adaptive gradient clipping, returning clipped copies of the gradients.

    Args:
        parameters: the model (its ``named_parameters()`` are used, and ConvTranspose weights get
            their dim-1 output unit automatically), ``model.named_parameters()`` pairs, or plain
            tensors (then ``exclude``/``dims`` are unavailable).
        gradients: one gradient ``[*param]`` (or None) per parameter, in the same order; default
            each parameter's ``.grad``. For accumulated training pass the window gradient
            (unscaled), not a micro-step's.
        clip_factor: lambda, the largest allowed ratio ``||G_i|| / max(||W_i||, eps)``, > 0.
        eps: floor on the weight norm so zero-initialised units can still move, > 0.
        exclude: parameter names returned unclipped (the paper leaves the final classifier
            unclipped, e.g. ``exclude=("fc.weight", "fc.bias")``). Unknown names raise.
        dims: per-name override of the dims reduced by :func:`unitwise_norm`.

    Returns:
        One entry per parameter: a new tensor ``[*param]``, or None where the gradient is None.
        Excluded parameters get their gradient back unchanged (the same tensor).
    """
    _check_args(clip_factor, eps)
    named, excluded, overrides = _resolve(parameters, exclude, dims)
    if gradients is None:
        gradients = [p.grad for _, p in named]
    else:
        gradients = list(gradients)
        if len(gradients) != len(named):
            raise ValueError(
                f"gradients has {len(gradients)} entries but there are {len(named)} parameters; "
                f"give one gradient (or None) per parameter, in the same order."
            )
    out: list[Tensor | None] = []
    for (name, w), g in zip(named, gradients):
        if g is None or (name is not None and name in excluded):
            out.append(g)
            continue
        if g.shape != w.shape:
            raise ValueError(
                f"gradient for parameter {name or ''} has shape {tuple(g.shape)}, the parameter "
                f"{tuple(w.shape)}; pass gradients in parameter order."
            )
        g = g.detach()
        out.append(g * _clip_one(w, g, clip_factor, eps, overrides.get(name) if name else None))
    return out


@torch.no_grad()
def adaptive_clip_grad_(
    parameters: ParamsArg,
    clip_factor: float = 0.01,
    eps: float = 1e-3,
    *,
    exclude: Iterable[str] = (),
    dims: Mapping[str, Dim] | None = None,
) -> None:
    """In-place AGC on each parameter's ``.grad`` (same rule and arguments as
    :func:`adaptive_clip_grad`).

    Usable directly as ``GradientAccumulateOptimizer(..., clip=adaptive_clip_grad_)`` (no
    exclusions), or with names as ``clip=lambda _: adaptive_clip_grad_(model,
    exclude=("fc.weight", "fc.bias"))``: the wrapper calls ``clip`` once per window, when every
    ``.grad`` holds the window gradient.
    """
    _check_args(clip_factor, eps)
    named, excluded, overrides = _resolve(parameters, exclude, dims)
    for name, w in named:
        g = w.grad
        if g is None or (name is not None and name in excluded):
            continue
        g.mul_(_clip_one(w, g, clip_factor, eps, overrides.get(name) if name else None))
