"""One tracked window as one value: what the Lens opens, the Meter fills micro-step by micro-step,
the ranks merge, the record reads and a checkpoint saves.

A :class:`Window` is opened by the Lens when a tracked window starts and replaced by a fresh one
when the window closes, is skipped or discarded, or a capture fails half way (its sums are
accumulated in place, so a micro-step that stopped early spoils them): dropping a window is
dropping this object. An untracked window has none (``None``). The Meter takes it at the start
of a micro-step and gives it back folded (:meth:`gradlens.measure.meter.Meter.begin`,
:meth:`~gradlens.measure.meter.Meter.fold`, :meth:`~gradlens.measure.meter.Meter.settle`); the
merge across ranks returns the window of all ranks (:func:`gradlens.distributed.merge.merge_window`);
the Lens state saves it whole (:mod:`gradlens.lens.state`).

What lives longer than one window stays outside: the record waiting for the next window
(:class:`gradlens.lens.record.PendingRecord`), the buffers reused across windows (the pools of
:class:`~gradlens.core.stats.Accumulators`), the window counters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gradlens.core.stats import Accumulators, WindowStats

__all__ = ["Window"]


@dataclass(eq=False)
class Window:
    """The state of one tracked window (module docstring).

    Attributes:
        stats: the window's shared sums (:class:`~gradlens.core.stats.WindowStats`: N, K, the
            loss, the ``[B_k]`` per-sample norms, the per-parameter sums), in per-sample units.
        states: ``id(instrument) -> window state`` of every instrument of the Lens
            (:meth:`gradlens.instruments.Instrument.start_window`, merged micro-step by micro-step).
        sites: use name -> :class:`gradlens.capture.Site`, every use measured in this window
            (the rank merge lays out its per-use pieces by them).
        carried: stacked small uses of the folded micro-steps, not measured yet
            (:func:`gradlens.measure.deferred.carry`: stack key -> blocks, one per micro-step);
            :func:`gradlens.measure.deferred.settle` measures them before anything reads
            ``stats``; ``carried_elements``: their elements (input and output gradient).
        sum_blocks: the ``[k, *param]`` window-gradient blocks of stacked uses whose rows are
            ``stats``' accumulators (:func:`gradlens.measure.deferred.settle` adds a later
            block onto them in one operation); a cache, rebuilt when missing.
        empty_micro_steps: captures of this window whose backward reached no sample.
        coverage: the tracked parameters' fraction of the model's trainable elements as of the
            window's opening (``record.meta["coverage"]``).
        contribution: parameters whose per-sample values in this window are contributions
            (``Lens(undefined="contribution")``): name -> the layer or operation that mixed the
            samples (``record.meta["contribution"]``).
    """

    stats: WindowStats
    states: dict[int, Any]
    sites: dict[str, Any] = field(default_factory=dict)
    carried: dict = field(default_factory=dict)
    carried_elements: int = 0
    sum_blocks: dict = field(default_factory=dict)
    empty_micro_steps: int = 0
    coverage: float = 1.0
    contribution: dict = field(default_factory=dict)

    @classmethod
    def open(cls, pools: dict[str, dict], states: dict[int, Any], coverage: float) -> "Window":
        """A fresh window: its large sums (``sum_grad_squared``, ``grad_sum``) reuse the buffers
        that ``pools`` (name -> buffers, kept by the Lens across windows) hold."""
        stats = WindowStats(sum_grad_squared=Accumulators(pools.setdefault("sum_grad_squared", {})),
                            grad_sum=Accumulators(pools.setdefault("grad_sum", {})))
        return cls(stats, states, coverage=coverage)

    @property
    def micro_steps(self) -> int:
        """K, the micro-steps folded into the window so far (empty ones not counted)."""
        return self.stats.micro_steps

    def merged(self, stats: WindowStats, states: dict[int, Any]) -> "Window":
        """The same window with the statistics and instrument states of all ranks (after
        :func:`gradlens.distributed.merge.merge_window`; its stacked uses were settled first)."""
        return Window(stats, states, self.sites, empty_micro_steps=self.empty_micro_steps, coverage=self.coverage,
                      contribution=self.contribution)
