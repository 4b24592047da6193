"""Shared helpers for the training-side tests (accumulation, AGC, BatchNorm, DDP)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

D_IN, D_HIDDEN, D_OUT = 5, 7, 3


def make_mlp(seed: int = 0, dtype: torch.dtype = torch.float64) -> nn.Module:
    """A tiny MLP ``[B, 5] -> [B, 3]``, deterministic for a seed."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D_IN, D_HIDDEN), nn.Tanh(), nn.Linear(D_HIDDEN, D_OUT)).to(dtype)


def make_data(n: int, seed: int = 1, dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor]:
    """Regression data ``x [n, 5]``, ``y [n, 3]``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D_IN, generator=g, dtype=dtype)
    y = torch.randn(n, D_OUT, generator=g, dtype=dtype)
    return x, y


OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-2),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5),
}


@dataclass(frozen=True)
class SplitCase:
    """Micro-batch sizes per window; a last window shorter than ``accum_steps`` is flushed."""

    name: str
    accum_steps: int
    windows: tuple[tuple[int, ...], ...]


SPLITS = [
    SplitCase("k1", 1, ((6,), (4,), (5,))),
    SplitCase("equal_k2", 2, ((3, 3), (3, 3), (3, 3))),
    SplitCase("equal_k4", 4, ((2, 2, 2, 2), (2, 2, 2, 2))),
    SplitCase("unequal_k3", 3, ((1, 4, 2), (5, 1, 3), (2, 2, 6))),
    SplitCase("partial_last", 4, ((3, 1, 2, 5), (2, 2, 2, 2), (4, 1))),
]


def inner_step_count(opt: torch.optim.Optimizer) -> int | None:
    """The inner optimizer's per-parameter step counter (None for plain SGD, which has none)."""
    for state in opt.state.values():
        if "step" in state:
            return int(state["step"])
    return None


def rel_err(a: Tensor, b: Tensor) -> float:
    """``||a - b|| / ||b||`` in float64."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def assert_params_close(m1: nn.Module, m2: nn.Module, tol: float) -> None:
    for (name, p), q in zip(m1.named_parameters(), m2.parameters()):
        err = rel_err(p, q)
        assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.1e}"
