"""How long a Lens's collectives wait for the other ranks (``Lens(timeout=...)``), and the error
that says which limit ended a wait: the Lens's own, or the process group's where that is
shorter (a wait lasts the smaller of the two). Imported by :mod:`gradlens.distributed.merge`,
which re-exports its names."""

from __future__ import annotations

import math
import time
from datetime import timedelta
from typing import Any

from gradlens import compat

__all__ = ["DEFAULT_TIMEOUT_S", "check_timeout", "wait"]

#: seconds a Lens's collective waits for the other ranks before it raises (``Lens(timeout=...)``)
DEFAULT_TIMEOUT_S = 300.0


def check_timeout(timeout: Any) -> float | None:
    """``Lens(timeout=...)``: seconds > 0 (finite), or None (the process group's own)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (
        math.isfinite(timeout) and timeout > 0
    ):
        raise ValueError(
            f"timeout must be a number of seconds > 0 or None (the process group's own timeout), "
            f"got {timeout!r}; e.g. Lens(..., timeout={DEFAULT_TIMEOUT_S:g})"
        )
    return float(timeout)


def wait(work: Any, timeout: float | None, what: str, group: Any = None) -> None:
    """``work.wait()`` of an ``async_op=True`` collective over ``group``, at most ``timeout``
    seconds (None: the process group's timeout); a collective that fails or times out raises a
    RuntimeError naming ``what`` and the limit that ended the wait: ``Lens(timeout=...)``, or
    the process group's own timeout where shorter (a wait lasts the smaller of the two)."""
    start = time.monotonic()
    try:
        work.wait() if timeout is None else work.wait(timeout=timedelta(seconds=timeout))
    except Exception as err:
        waited, own = time.monotonic() - start, compat.process_group_timeout(group)
        stalled = "another rank has not reached it (stalled, crashed, or its Lens tracks other windows)"
        if timeout is not None and own is not None and own < timeout:
            raise RuntimeError(
                f"{what} across ranks failed after {waited:.1f} s, before the Lens's timeout={timeout:g} s: "
                f"the process group's own timeout ({own:g} s) is shorter and ends every wait first (a "
                f"wait lasts the smaller of the two); {stalled}. Make every rank run the same windows "
                "with the same Lens; to wait longer, raise the process group's timeout (init_process_group"
                f"(..., timeout=timedelta(seconds=...))), not Lens(timeout=...). ({type(err).__name__}: {err})"
            ) from err
        limit = "the process group's timeout (timeout=None)" if timeout is None else f"timeout={timeout:g} s"
        raise RuntimeError(
            f"{what} across ranks failed or did not complete within {limit}: {stalled}. Make every rank "
            "run the same windows with the same Lens; Lens(..., timeout=seconds) sets how long to wait "
            f"(this one ended after {waited:.1f} s). ({type(err).__name__}: {err})"
        ) from err
