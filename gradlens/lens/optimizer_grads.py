"""The Lens's calls into instruments that compare what the optimizer steps with to the window
(those that set ``Instrument.reads_optimizer_grads``:
:class:`~gradlens.instruments.accumulation.AccumulationCheck`): around each captured backward,
when a :class:`~gradlens.GradientAccumulateOptimizer` has written its window gradient, and right
before the update with the merged window. Nothing runs for a Lens without such an instrument.
"""

from __future__ import annotations

from typing import Any, Sequence

from gradlens.core.window import Window
from gradlens.instruments.base import Instrument
from gradlens.training.accum_optimizer import GradientAccumulateOptimizer

__all__ = ["OptimizerGrads"]

#: why the optimizer's gradient cannot be read on an FSDP2-sharded model
_SHARDED = (
    "not measured: under FSDP2 (fully_shard) the gradient the optimizer steps with lives in the "
    "sharded parameters' .grad (DTensor shards on each rank), which the Lens does not read; the "
    "window gradient (GradNorm) is measured"
)


class OptimizerGrads:
    """The readers among ``instruments`` and the Lens's calls into them.

    Args:
        instruments: the Lens's instruments.
        sharded: the Lens tracks an FSDP2-sharded model (the readers note why they cannot measure).
    """

    def __init__(self, instruments: Sequence[Instrument], sharded: bool):
        self.readers = [i for i in instruments if i.reads_optimizer_grads]
        for inst in self.readers:
            if sharded:
                inst.unmeasurable = _SHARDED

    def hooks(self, optimizer: Any, on_written) -> list:
        """The hook of ``optimizer`` (a GradientAccumulateOptimizer) that tells the readers its
        window gradient is in ``p.grad`` (``on_written()``); none otherwise."""
        if not self.readers or not isinstance(optimizer, GradientAccumulateOptimizer):
            return []
        return [optimizer.register_window_grad_hook(lambda opt: on_written())]

    def before_backward(self, window: Window | None, micro: Any) -> None:
        for inst in self.readers:
            if window is not None:
                inst.grads_before_backward(window.states[id(inst)], micro)

    def after_backward(self, window: Window | None, micro: Any, scaler: Any) -> None:
        for inst in self.readers:
            if window is not None:
                inst.grads_after_backward(window.states[id(inst)], micro, scaler)

    def written(self, window: Window | None) -> None:
        for inst in self.readers:
            if window is not None:
                inst.grads_written(window.states[id(inst)])

    def before_update(self, window: Window | None, scaler: Any) -> None:
        for inst in self.readers:
            if window is not None:
                inst.grads_before_update(window.states[id(inst)], window.stats, scaler)

    def abort(self) -> None:
        """A capture ends (normally or not): the readers remove what they hooked for its backward."""
        for inst in self.readers:
            inst.grads_abort()
