"""Backward passes that gradlens runs itself inside a captured backward (the per-sample
gradients of a parameter used through a parameters-only computation, taken back with one batched
vector-Jacobian product: :func:`gradlens.capture.ops.chain_to_params`). Parameter hooks that
collect the micro-step's own gradient (the curvature instruments' window graph, the micro-step
gradient norms of the noise scale) stand aside while one runs: what reaches them then is a
per-sample gradient, not a part of the window's."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

__all__ = ["side_backward", "in_side_backward"]

# (a nested backward runs its hooks on the thread that started it: the flag is per thread)
_state = threading.local()


@contextmanager
def side_backward() -> Iterator[None]:
    """Mark the backward passes run inside as gradlens' own."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def in_side_backward() -> bool:
    """Whether a hook now runs inside one of gradlens' own backward passes."""
    return getattr(_state, "depth", 0) > 0
