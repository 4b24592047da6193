"""Host-device synchronisation: which code paths a tensor may take.

On an accelerator, reading a value back to the host (``.item()``, ``int(t)``, ``bool(t)``,
``nonzero``, boolean-mask indexing, ``bincount``'s output length, a branch on a tensor) waits
for the device: once per layer per micro-step that stalls the GPU. gradlens' hot path (the
backward hooks and the instruments' per-micro-step updates) therefore takes *device paths*
with fixed shapes and no host reads whenever the data lives on a device; host reads happen once
per window, when it closes. On the CPU a host read costs nothing (there is no device to wait
for), so the CPU takes data-dependent shortcuts where they are faster (e.g. the rank-one
histogram searches of :mod:`gradlens.instruments.outer_hist`).

:func:`forced_device_paths` runs the device paths on the CPU: the test suite uses it to check
that they make no host read and give the same numbers.
"""

from __future__ import annotations

import contextlib

from torch import Tensor

__all__ = ["device_paths", "forced_device_paths"]

_forced = 0


def device_paths(t: Tensor) -> bool:
    """Whether work on ``t`` must avoid host reads (``t`` on an accelerator, or forced)."""
    return _forced > 0 or t.device.type != "cpu"


@contextlib.contextmanager
def forced_device_paths():
    """Within this block, CPU tensors take the device paths too (for tests and comparisons)."""
    global _forced
    _forced += 1
    try:
        yield
    finally:
        _forced -= 1
