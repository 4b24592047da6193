"""Backward passes that gradlens runs itself inside a captured backward (the per-sample
gradients of a parameter used through a parameters-only computation, taken back with one batched
vector-Jacobian product: :func:`gradlens.capture.ops.chain_to_params`). Parameter hooks that
collect the micro-step's own gradient (the curvature instruments' window graph, the micro-step
gradient norms of the noise scale) stand aside while one runs: what reaches them then is a
per-sample gradient, not a part of the window's."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

__all__ = ["side_backward", "in_side_backward"]

# Process-wide, not per thread: a nested backward on an accelerator may run its hooks on the
# autograd engine's device thread, not on the thread that started it; the captured backward that
# starts one waits for it, so nothing else of that micro-step runs meanwhile.
_depth = [0]


@contextmanager
def side_backward() -> Iterator[None]:
    """Mark the backward passes run inside as gradlens' own."""
    _depth[0] += 1
    try:
        yield
    finally:
        _depth[0] -= 1


def in_side_backward() -> bool:
    """Whether a hook now runs inside one of gradlens' own backward passes."""
    return _depth[0] > 0
