"""The record of a closed window: what the Lens writes when a tracked window closes.

:func:`window_record` turns a window (:class:`~gradlens.core.window.Window`: its merged statistics
and the instruments' window states) into one :class:`~gradlens.core.records.Record`: each instrument's
finalized value under its key (per group too, ``record.groups``), the window's mean loss and the
meta data; :func:`keep_record` keeps it as ``Lens(keep_records=...)`` says; :class:`PendingRecord` holds one
that waits for the next window (Alpha) until that window completes it.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from gradlens.instruments.base import Instrument

from gradlens.core.records import Record
from gradlens.core.window import Window
from gradlens.measure.undefined import CONTRIBUTION

__all__ = ["RESERVED_KEYS", "PendingRecord", "end_window", "keep_record", "window_record"]

#: record keys the Lens writes itself (:func:`window_record`); no instrument may take them
RESERVED_KEYS = ("loss",)


def window_record(step: int, whole: Window, instruments: Sequence[Instrument],
                  groups: dict[str, tuple[str, ...]] | None = None) -> Record:
    """The record of a captured window: each instrument's finalized value under its key, the
    window's mean loss (None if unknown) and the meta data (coverage as of the window's opening,
    units, empty micro-steps, what the instruments add)."""
    window, states, empty = whole.stats, whole.states, whole.empty_micro_steps
    values = {i.key: i.finalize(window, states[id(i)]) for i in instruments}
    for i in instruments:
        values.update(i.extra(states[id(i)]))  # values beside record[key], e.g. hess_trace_stderr
    loss_value = window.window_loss()
    unknown = window.loss_unknown > 0  # a micro-step had no loss to read (Meter.fold)
    values["loss"] = None if unknown else loss_value
    record = Record(step, window.num_samples, window.micro_steps, values)
    record.meta["coverage"] = whole.coverage  # as of the window's opening
    if unknown:
        record.meta["loss"] = (
            "unknown: a functional loss without loss=; use lens.capture(reduction=..., loss=loss)"
        )
    elif not math.isfinite(loss_value):
        record.meta["loss"] = (
            f"non-finite: the window's loss is {loss_value} (a micro-step's loss was nan or "
            "inf); the value is kept as it is"
        )
    if empty:
        record.meta["empty_micro_steps"] = empty
    record.meta["units"] = (
        "g_n = B_k * d(micro-step objective)_n (mean objective)"
        if window.reduction == "mean"
        else "g_n = d(micro-step objective)_n (sum objective)"
    )
    if whole.contribution:  # Lens(undefined="contribution") measured these as contributions
        record.meta["contribution"] = dict(whole.contribution)
        record.meta["units"] += "; " + CONTRIBUTION
    for i in instruments:
        record.meta.update(i.meta(states[id(i)]))
    per_group = [i for i in instruments if i.per_group]
    for group, names in (groups or {}).items():  # the window seen through each group
        view = window.restrict(group, names)
        record.groups[group] = {i.key: i.finalize_group(view, states[id(i)], names) for i in per_group}
    return record


def end_window(states: dict[int, Any], instruments: Sequence[Instrument]) -> dict[int, Any]:
    """The instruments end the window whose record was just made (:meth:`Instrument.end_window`:
    adaptive ranges move on, ...). Returns the window states of those that defer the record
    (:meth:`Instrument.defers`, e.g. Alpha: the next window completes it), ``{}`` if none."""
    deferring = {id(i): states[id(i)] for i in instruments if i.defers(states[id(i)])}
    for i in instruments:
        i.end_window(states[id(i)])
    return deferring


def keep_record(records: list[Record], record: Record, keep: bool | int) -> None:
    """Append ``record`` to ``records`` as ``Lens(keep_records=...)`` says: all, none, the last n."""
    if keep is True or keep > 0:
        records.append(record)
        if keep is not True and len(records) > keep:
            del records[: len(records) - keep]


class PendingRecord:
    """The record of a window that waits for the next one (an instrument whose
    :meth:`~gradlens.instruments.Instrument.defers` is true, e.g. Alpha, completes it from the
    next window's states). It is in :attr:`Lens.records <gradlens.Lens.records>` at once, and
    written to the sinks when :meth:`settle` completes it or marks what it lacks.

    Attributes:
        held: ``(record, {id(instrument): window state})`` of the deferring instruments, or None.
    """

    def __init__(self) -> None:
        self.held: tuple[Record, dict[int, Any]] | None = None

    def settle(self, instruments: Sequence[Instrument], reason: str | None, closing: dict[int, Any],
               write: Any) -> None:
        """Complete the held record from the window now closing (its states ``closing``, used
        when ``reason is None``) or mark what it lacks (``reason``), then ``write(record)``."""
        if self.held is None:
            return
        record, states = self.held
        self.held = None
        for i in instruments:
            if id(i) in states:
                i.settle(record, states[id(i)], None if reason else closing[id(i)], reason)
        write(record)
