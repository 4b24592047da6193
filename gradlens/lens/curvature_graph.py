"""The graphs that curvature instruments differentiate again: a tracked window's Lens-side glue.

HessMaxEV, HessTrace, TICDiag and TICTrace (``"graph_grad"`` in their ``needs``) compute
Hessian-vector products of the window objective from the micro-steps' gradients *with* their
autograd graphs (``loss.backward(create_graph=lens.create_graph)``). :class:`CurvatureGraph` gives
each tracked window one :class:`~gradlens.instruments.curvature.WindowGraph` shared by all of them,
binds it to their window states, feeds it each micro-step and releases it (and the graphs) when the
window goes.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from gradlens.instruments.base import Instrument
from gradlens.instruments.curvature import WindowGraph

__all__ = ["CurvatureGraph"]


class CurvatureGraph:
    """The window graph of a Lens' curvature instruments (module docstring).

    Attributes:
        instruments: the instruments that need it (none: nothing is ever built).
        graph: the current tracked window's :class:`~gradlens.instruments.curvature.WindowGraph`,
            or None (untracked window, released, or no curvature instrument).
    """

    def __init__(self, instruments: Sequence[Instrument]):
        self.instruments = [i for i in instruments if "graph_grad" in i.needs]
        self.graph: WindowGraph | None = None

    def open(self, params: dict, group: Any, model: Any, meter: Any) -> None:
        """A tracked window opens: its graph, whose parameter hooks collect the micro-steps'
        gradients; the Meter sees it (the window's states: :meth:`bind`)."""
        if self.instruments:
            self.graph = WindowGraph(params, group, model)
            self.graph.install()
            meter.graph = self.graph

    def bind(self, states: dict[int, Any]) -> None:
        """Bind the instruments' window states (``id(instrument) -> state``: a window just
        opened, or loaded from a checkpoint) to the graph."""
        for i in self.instruments:
            i.bind_graph(states[id(i)], self.graph)

    def end_micro(self, micro: Any, drop: Callable[[], None]) -> None:
        """A captured micro-step (a :class:`~gradlens.capture.units.MicroStep`) ends: its gradient with
        its graph joins the window's. Without a graph (``create_graph=False``) the window is
        dropped (``drop()``) and the RuntimeError goes through."""
        micro.resolve()
        try:
            self.graph.end_micro(micro.scale(), micro.batch_size, micro.reduction)
        except RuntimeError:
            drop()
            raise

    def release(self, meter: Any) -> None:
        """The window goes: its graphs are freed."""
        if self.graph is not None:
            self.graph.release()
            self.graph = meter.graph = None
