"""The record of a closed window: what the Lens writes when a tracked window closes.

:func:`window_record` turns a window's merged statistics (:class:`~gradlens.instruments.base.WindowStats`)
and the instruments' window states into one :class:`~gradlens.records.Record`: each instrument's
finalized value under its key (per group too, ``record.groups``), the window's mean loss and the
meta data; :func:`keep_record` keeps it as ``Lens(keep_records=...)`` says.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from gradlens.instruments.base import Instrument, WindowStats
from gradlens.records import Record

__all__ = ["RESERVED_KEYS", "keep_record", "window_record"]

#: record keys the Lens writes itself (:func:`window_record`); no instrument may take them
RESERVED_KEYS = ("loss",)


def window_record(step: int, window: WindowStats, states: dict[int, Any], instruments: Sequence[Instrument],
                  coverage: float, empty: int, groups: dict[str, tuple[str, ...]] | None = None) -> Record:
    """The record of a captured window: each instrument's finalized value under its key, the
    window's mean loss (None if unknown) and the meta data (coverage as of the window's opening,
    units, empty micro-steps, what the instruments add)."""
    values = {i.key: i.finalize(window, states[id(i)]) for i in instruments}
    for i in instruments:
        values.update(i.extra(states[id(i)]))  # values beside record[key], e.g. hess_trace_stderr
    loss_value = window.window_loss()
    unknown = window.loss_unknown > 0  # a micro-step had no loss to read (Meter.fold)
    values["loss"] = None if unknown else loss_value
    record = Record(step, window.num_samples, window.micro_steps, values)
    record.meta["coverage"] = coverage  # as of the window's opening
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
    for i in instruments:
        record.meta.update(i.meta(states[id(i)]))
    per_group = [i for i in instruments if i.per_group]
    for group, names in (groups or {}).items():  # the window seen through each group
        view = window.restrict(group, names)
        record.groups[group] = {i.key: i.finalize_group(view, states[id(i)], names) for i in per_group}
    return record


def keep_record(records: list[Record], record: Record, keep: bool | int) -> None:
    """Append ``record`` to ``records`` as ``Lens(keep_records=...)`` says: all, none, the last n."""
    if keep is True or keep > 0:
        records.append(record)
        if keep is not True and len(records) > keep:
            del records[: len(records) - keep]
