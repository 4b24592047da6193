"""When a Lens' tracked window is merged across ranks: ``Lens(merge="sync" | "deferred")``.

:mod:`gradlens.distributed.merge` merges a window (one all_reduce, plus one all_gather); this module
keeps the Lens' bookkeeping of *when*: once per tracked window, at the real update that closes it.
``merge="sync"`` waits for the collective there, so the window's record is complete at once.
``merge="deferred"`` issues it there (what depends on ``p.grad`` is read before the update) and
lets it run during the next window: the closed window waits *in flight* (its step and its
:class:`~gradlens.core.window.Window`) and gets its record when the next window closes, or at
``flush()`` / ``close()`` / ``state_dict()``. Deferred merging is for instruments of the window
gradient only, whose next window does not depend on the merged one.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from gradlens.distributed.merge import (
    DDPGradRoute, MergeContext, Pending, check_ranks_agree, check_timeout, lens_fingerprint, merge_window,
    merge_window_start,
)
from gradlens.instruments.base import Instrument
from gradlens.core.stats import LIGHT_QUANTITIES
from gradlens.core.window import Window

__all__ = ["RankMerge", "check_merge"]


def check_merge(merge: str, instruments: Sequence[Instrument], light: bool) -> None:
    """``Lens(merge=...)``: "deferred" only for instruments of the window gradient (``light``)."""
    if merge not in ("sync", "deferred"):
        raise ValueError(f"merge must be 'sync' or 'deferred', got {merge!r}")
    if merge == "deferred" and not light:
        heavy = sorted({type(i).__name__ for i in instruments
                        if set(i.needs) - LIGHT_QUANTITIES or i.reads_optimizer_grads})
        raise ValueError(
            f"Lens(merge='deferred') is for instruments of the window gradient only (GradNorm, "
            f"NoiseScaleTwoBatch); {heavy} need per-sample statistics whose next window depends "
            "on the merged one (histogram ranges, Alpha's direction), or the merged window at the "
            "update (AccumulationCheck): use merge='sync' (the default)"
        )


class RankMerge:
    """The merge schedule of one Lens (module docstring).

    Args:
        group: the process group (None: one process, nothing is merged).
        merge: ``"sync"`` or ``"deferred"`` (checked with :func:`check_merge`).
        timeout: seconds each collective waits (checked: :func:`gradlens.distributed.merge.check_timeout`).
        instruments: the Lens' instruments.
        plan: their :class:`~gradlens.measure.meter.Plan` (``light``: they read the window gradient
            only; ``needs``: the quantities they need).

    Attributes:
        route: under DDP, when the instruments need ``grad_sum``: the
            :class:`~gradlens.distributed.merge.DDPGradRoute` that reads the global sum from DDP's
            all-reduced ``p.grad`` when that is exact; else None.
        done: the current window was merged (or its collective issued): once per window.
        issued: ``merge="deferred"``: the current window's collective, issued and not finished.
        inflight: ``(step, window, issued)`` of a closed window whose collective still runs.
        memo: the gathered shapes of the last merge (:func:`gradlens.distributed.merge.exchange`).
    """

    def __init__(self, group: Any, merge: str, timeout: Any, instruments: Sequence[Instrument], plan: Any):
        # light: the instruments read ||sum g_n||^2 only, never sum_n g_n per parameter at the
        # update (AccumulationCheck does: it compares it with p.grad)
        light = plan.light and not any(i.reads_optimizer_grads for i in instruments)
        check_merge(merge, instruments, light)
        self.group = group
        self.mode = merge
        self.timeout = check_timeout(timeout)
        self.route = (
            DDPGradRoute(group, light=light) if group is not None and "grad_sum" in plan.needs else None
        )
        self.done = False
        self.issued: Pending | None = None
        self.inflight: tuple | None = None
        self.memo: dict = {}

    def check_agree(self, instruments: Sequence[Instrument], every: Any, step: int, params: dict,
                    groups: Any) -> None:
        """Once, when the Lens is built under torch.distributed: every rank has the same
        instruments and settings, schedule, merge mode, grouping and tracked parameters (one
        small all_reduce; :func:`gradlens.distributed.merge.check_ranks_agree`). Nothing otherwise."""
        if self.group is None:
            return
        fingerprint = lens_fingerprint(instruments, every, step, self.mode, params)
        if groups is not None:  # the parameters' grouping fixes the per-group layout
            fingerprint["parameters"] = f"groups={groups!r}; " + fingerprint["parameters"]
        check_ranks_agree(self.group, fingerprint, self.timeout)

    def due(self, window: Window | None) -> bool:
        """Whether ``window`` (None: untracked) is still to be merged."""
        return self.group is not None and window is not None and not self.done

    def context(self, params: dict, sites: list, needs: frozenset, route: Any, step: int,
                groups: tuple) -> MergeContext:
        """The :class:`~gradlens.distributed.merge.MergeContext` of the window ``step``."""
        return MergeContext(params, sites, needs, route=route, memo=self.memo, timeout=self.timeout,
                            step=step, groups=groups)

    def merge(self, window: Window, instruments: Sequence[Instrument], ctx: MergeContext, defer: bool,
              first: Callable[[], Any]) -> Window:
        """Merge the window: the :class:`~gradlens.core.window.Window` of all ranks. With
        ``merge="deferred"`` and ``defer``, ``first()`` (the window in flight finishes first:
        collectives of a group run in the order they were issued), then the window's collective
        is issued and ``window`` comes back unchanged; :meth:`hold` and :meth:`finish_inflight`
        do the rest."""
        if self.mode == "deferred" and defer:
            first()
            self.issued = merge_window_start(window, instruments, self.group, ctx)
        else:
            window = merge_window(window, instruments, self.group, ctx)
        self.done = True
        return window

    def hold(self, step: int, window: Window | None) -> bool:
        """At the window's close: if its collective was issued, keep the window in flight (True);
        its record comes from :meth:`finish_inflight`."""
        if self.issued is None:
            return False
        self.inflight = (step, window, self.issued)
        self.issued = None
        return True

    def finish_inflight(self) -> tuple[int, Window] | None:
        """Wait for the window in flight: ``(step, window)`` merged, or None."""
        if self.inflight is None:
            return None
        step, _, issued = self.inflight
        self.inflight = None
        return step, issued.finish()

    def drop_issued(self) -> None:
        """A new window opens: a collective issued for a window dropped since is finished (every
        rank waits for it; its result is not used). The opener sets ``done = False`` once the
        new window is set up."""
        if self.issued is not None:
            self.issued.finish()
            self.issued = None
