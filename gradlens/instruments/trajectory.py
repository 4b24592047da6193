"""Where the parameters go: the distance from the start (:class:`Distance`) and the size of
each update (:class:`UpdateSize`), over the tracked parameters (Cockpit's ``Distance``
quantity, split in two).

Both read the parameters themselves, not the per-sample gradients: they need nothing from the
capture. Their window state is a per-parameter dict of squared norms (0-d float64 tensors on
the parameters' device, no host read until the record is made), which adds over parameters, so
a group of parameters gets its own value by summing its entries. The parameters are the same
on every rank under data parallelism, so nothing is sent when ranks merge.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import Tensor

from gradlens.instruments.base import Instrument

from gradlens.core.stats import DistParts, WindowStats
from gradlens.core.state_checks import TENSORS, check_state

__all__ = ["Distance", "UpdateSize", "SquaredNorms"]


@dataclass
class SquaredNorms:
    """A window state of :class:`Distance` / :class:`UpdateSize`: ``sq`` parameter name ->
    0-d float64 squared norm (None until measured); ``snapshot`` holds theta_t during the
    optimizer's update (UpdateSize only); ``presented``: the parameters' full values the Lens
    hands over right before the next ``before_update`` / ``after_update`` on a sharded model
    (FSDP2, DeepSpeed ZeRO-3; read once, then dropped; never saved). Merging adds the squares of
    the same parameter (the states of micro-steps and ranks hold none: the parameters are
    measured once per window)."""

    sq: dict[str, Tensor] | None = None
    snapshot: dict[str, Tensor] | None = None
    note: str = ""
    presented: dict[str, Tensor] | None = None

    def merge(self, other: "SquaredNorms") -> "SquaredNorms":
        if other.sq is None:
            return self
        if self.sq is None:
            return other
        out = dict(self.sq)
        for q, v in other.sq.items():
            out[q] = out[q] + v if q in out else v
        return SquaredNorms(out, self.snapshot, self.note, self.presented)

    def norm(self, names: Iterable[str] | None = None) -> float | None:
        """sqrt of the summed squares (a host read) over all parameters, or over ``names`` (a
        group's parameters), None if not measured."""
        if self.sq is None:
            return None
        keep = self.sq if names is None else {q: self.sq[q] for q in names if q in self.sq}
        total = sum(keep.values(), torch.zeros((), dtype=torch.float64))
        return math.sqrt(float(total))


def _sq(d: Tensor) -> Tensor:
    flat = d.reshape(-1)
    return torch.dot(flat, flat).double()


def _wide(t: Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


class _ParameterInstrument(Instrument):
    """Shared plumbing: the tracked parameters from :meth:`Instrument.attach`, a
    :class:`SquaredNorms` window state, nothing sent across ranks."""

    needs = frozenset()

    def __init__(self) -> None:
        self._params: Callable[[], Mapping[str, Tensor]] | None = None

    def attach(self, params, optimizer) -> None:
        self._params = params

    def _tracked(self) -> Mapping[str, Tensor]:
        if self._params is None:
            raise RuntimeError(
                f"{type(self).__name__} reads the tracked parameters, which a Lens hands it when "
                f"built; use it inside one: Lens(model, [{type(self).__name__}()], optimizer=opt)"
            )
        return self._params()

    def start_window(self) -> SquaredNorms:
        return SquaredNorms()

    #: theta_t and theta_{t+1} are read around the update: on a sharded model (FSDP2, DeepSpeed
    #: ZeRO-3) the Lens presents their gathered full values (:meth:`present_values`); on other
    #: models the parameters are read themselves
    reads_update_values = True

    def present_values(self, state: SquaredNorms, values: Mapping[str, Tensor]) -> None:
        state.presented = dict(values)

    def _current(self, state: SquaredNorms) -> Mapping[str, Tensor]:
        """The tracked parameters' values now: those the Lens presented for this call (then
        dropped), else the parameters (:meth:`_tracked`)."""
        got, state.presented = state.presented, None
        return got if got is not None else self._tracked()

    def merge(self, a: SquaredNorms, b: SquaredNorms) -> SquaredNorms:
        return a.merge(b)

    def to_buffers(self, state, ctx):
        """Nothing to send: the parameters are the same on every rank (DDP keeps them equal),
        so each rank measures the same value."""

        return DistParts()

    def from_buffers(self, state, ctx, sums, per_rank, pieces):
        return state

    def meta(self, state: SquaredNorms) -> dict[str, Any]:
        return {self.key: state.note} if state.note else {}

    #: ``record.groups[g][key]``: the same norm over the group's parameters
    per_group = True

    def finalize_group(self, stats: WindowStats, state: SquaredNorms, names: tuple[str, ...]) -> float | None:
        if state.sq is None:  # finalize measures what is still missing (and notes why)
            self.finalize(stats, state)
        return state.norm(names)


class Distance(_ParameterInstrument):
    """``record["distance"]``: float, ||theta_t - theta_0|| over the tracked parameters (L2,
    parameter units), theta_0 the parameters when the Lens was built and theta_t those at
    which this window's gradients were taken (read right before the optimizer's update, or
    when the window closes without one).

    A parameter first tracked later (a layer unfrozen after the Lens was built) has its theta_0
    taken when it is first seen. Memory: a copy of every tracked parameter in its own dtype
    (D elements: 4 D bytes for float32 parameters, 2 D for bf16), on the parameters' device;
    the difference is formed in float32 or wider, one parameter at a time.

    Convention vs cockpit-for-pytorch's ``Distance`` (its ``d2init``): cockpit keeps theta_0 at
    its global step 0 and logs a list of per-parameter norms; gradlens logs their root sum of
    squares (per group with ``Lens(groups=...)``). Across checkpoints theta_0 is kept:
    :meth:`state_dict` holds it, so a resumed run measures from the same start.
    """

    key = "distance"

    def __init__(self) -> None:
        super().__init__()
        self._theta0: dict[str, Tensor] = {}

    def __repr__(self) -> str:
        return "Distance()"

    def attach(self, params, optimizer) -> None:
        super().attach(params, optimizer)
        self._theta0 = {q: p.detach().clone() for q, p in params().items()}

    def _measure(self, values: Mapping[str, Tensor]) -> dict[str, Tensor]:
        out = {}
        for q, p in values.items():
            if q not in self._theta0:  # tracked since: its start is now
                self._theta0[q] = p.detach().clone()
            t0 = self._theta0[q]
            wide = _wide(p)
            out[q] = _sq(p.detach().to(wide) - t0.to(device=p.device, dtype=wide))
        return out

    def before_update(self, state: SquaredNorms) -> None:
        state.sq = self._measure(self._current(state))  # theta_t: the point of this window's gradients

    def after_update(self, state: SquaredNorms) -> None:
        state.presented = None  # theta_{t+1}, presented for UpdateSize: not needed here

    def finalize(self, stats: WindowStats, state: SquaredNorms) -> float:
        if state.sq is None:  # closed without an update (lens.flush()): still at theta_t
            state.sq = self._measure(self._current(state))
        return state.norm()

    # ---- checkpoints (gradlens.lens.state) ----------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``theta0``: parameter name -> ``[*param]``, the start the distance is measured from."""
        return {"theta0": dict(self._theta0)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state(self, state, {"theta0": TENSORS})
        self._theta0 = {q: t.detach().clone() for q, t in state["theta0"].items()}

    def parameter_tensors(self, state: dict[str, Any]) -> dict[str, dict[str, Tensor]]:
        t0 = state.get("theta0") if isinstance(state, dict) else None
        return {"theta0": t0} if isinstance(t0, dict) else {}


class UpdateSize(_ParameterInstrument):
    """``record["update_size"]``: float, ||theta_{t+1} - theta_t|| over the tracked parameters
    (L2, parameter units): the size of the update that closed this window, whatever the
    optimizer did (momentum, Adam, clipping, weight decay, accumulation).

    theta_t is copied right before the optimizer's update and the difference formed right
    after it, in the parameters' dtype (as :class:`~gradlens.instruments.Alpha` forms the
    update direction) into the copy's memory. Memory: one copy of the tracked parameters,
    only during ``optimizer.step()``. A window closed without an update (``lens.flush()``, a
    step skipped by a GradScaler) gets ``None`` and ``record.meta["update_size"]`` says why.

    Convention vs cockpit-for-pytorch's ``Distance`` (its ``update_size``): cockpit logs a list
    of per-parameter norms of the step between two tracked iterations; gradlens logs their root
    sum of squares for the one update of the window (per group with ``Lens(groups=...)``).
    """

    key = "update_size"

    def __repr__(self) -> str:
        return "UpdateSize()"

    def before_update(self, state: SquaredNorms) -> None:
        state.snapshot = {q: p.detach().clone() for q, p in self._current(state).items()}

    def after_update(self, state: SquaredNorms) -> None:
        if state.snapshot is None:
            state.presented = None
            return
        params = self._current(state)
        sq = {}
        for q, before in state.snapshot.items():
            if q in params:
                sq[q] = _sq(torch.sub(params[q].detach(), before, out=before))
        state.snapshot = None
        state.sq = sq

    def finalize(self, stats: WindowStats, state: SquaredNorms) -> float | None:
        if state.sq is None:
            state.note = (
                "missing: no optimizer update closed this window (lens.flush(), a step skipped "
                "by a GradScaler, or no optimizer given to the Lens)"
            )
        return state.norm()
