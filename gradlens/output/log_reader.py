"""Reading a gradlens log back: :func:`load_log` (runs, segments, damaged lines, the full values
of ``<log>.arrays``). The file's format is :mod:`gradlens.output.log_format`; its writer is
:class:`~gradlens.output.jsonl.JsonlSink`.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from gradlens.core.records import Record
from gradlens.output.log_format import CorruptLine, PathLike, parse_header, parse_line

__all__ = ["load_log"]


def load_log(path: PathLike, *, arrays: bool = True, run: int | str = -1) -> list[Record]:
    """Read a JSON-lines log written by :class:`~gradlens.output.jsonl.JsonlSink` into a list
    of records.

    Runs and segments: a log may hold several runs (each fresh :class:`~gradlens.Lens` on a
    non-empty log starts one; its steps count from 0) and a run several segments (a Lens resumed
    from a checkpoint at step ``s`` goes on in a new segment). Per run, the records of a
    segment that starts at step ``s`` replace those ``>= s`` of the segments before it: a run
    resumed from a checkpoint shows each step once, with the record of the latest segment.
    ``run=-1`` (default) returns the last run, ``run=i`` run ``i`` (0-based, negative from the
    end), ``run="all"`` every run one after the other, each record with ``record.meta["run"]``
    set to its run index (otherwise ``meta`` is as written). When the log holds several runs
    and ``run`` is not given, one :class:`UserWarning` says so. Lines before the first header
    (a log written by one Lens, or by gradlens before runs existed) are run 0, in file order.

    Blank lines are skipped. Damaged lines anywhere in the file (a run killed while writing, a
    write cut by a full disk, a line glued to a cut one by an older writer, a corrupt disk
    block) are skipped: every complete record is returned and one :class:`UserWarning` names the
    file and the line numbers dropped. Values written in full next to the log
    (``JsonlSink(full=...)``) are read back from ``<log>.arrays`` when ``arrays`` is True (a
    missing file leaves the value ``None``, with a warning); with ``arrays=False`` they stay
    ``{"__array__": file, "key": key}`` references.
    ``record.groups`` is restored like the totals (the same summaries and array references).

    Raises:
        FileNotFoundError: ``path`` does not exist (the message gives the path).
        ValueError: no line of a non-empty file is a gradlens record; ``run`` names no run of
            the log.
    """
    path = Path(path)
    if not (run == "all" or (isinstance(run, int) and not isinstance(run, bool))):
        raise TypeError(f"load_log(run={run!r}) takes a run index (an int, -1 for the last) or 'all'")
    if not path.exists():
        raise FileNotFoundError(f"gradlens log not found: {str(path)!r}")
    if path.is_dir():
        raise IsADirectoryError(f"gradlens log {str(path)!r} is a folder, not a .jsonl file")
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    runs: dict[int, list[Record]] = {}
    current = 0
    bad: list[tuple[int, str]] = []
    good = 0
    for lineno, raw in numbered:
        header = parse_header(raw)
        if header is not None:
            current = header["run"]
            start = header["start"]
            runs[current] = [r for r in runs.get(current, []) if r.step < start]
            continue
        try:
            record = parse_line(raw)
        except CorruptLine as err:
            bad.append((lineno, str(err)))
            continue
        runs.setdefault(current, []).append(record)
        good += 1
    if bad and not good:
        lineno, why = bad[0]
        raise ValueError(
            f"gradlens log {str(path)!r} line {lineno} is corrupt ({why}); no line of the file "
            "is a gradlens record"
        )
    if bad:
        shown = ", ".join(f"line {n} ({why})" for n, why in bad[:10])
        more = f" and {len(bad) - 10} more" if len(bad) > 10 else ""
        warnings.warn(
            f"gradlens log {str(path)!r}: {len(bad)} truncated or corrupt line(s) skipped: "
            f"{shown}{more}; the {good} complete records were loaded",
            UserWarning,
            stacklevel=2,
        )
    ordered = [runs[r] for r in sorted(runs)]
    if run == "all":
        records = []
        for index, recs in enumerate(ordered):
            for r in recs:
                r.meta["run"] = index
            records.extend(recs)
    elif not ordered and run in (-1, 0):
        records = []
    else:
        if not -len(ordered) <= run < len(ordered):
            raise ValueError(
                f"load_log(run={run}): the log {str(path)!r} holds {len(ordered)} run(s); use "
                f"run=0..{len(ordered) - 1}, -1 for the last, or run='all'"
            )
        records = ordered[run]
        if run == -1 and len(ordered) > 1:
            warnings.warn(
                f"gradlens log {str(path)!r} holds {len(ordered)} runs (each fresh Lens on it "
                f"started one, steps from 0); returning the last ({len(records)} records); "
                "load_log(path, run=0) or run='all' gives the others",
                UserWarning,
                stacklevel=2,
            )
    if arrays:
        _load_arrays(path, records)
    return records


def _load_arrays(path: Path, records: list[Record]) -> None:
    """Replace, in place, every ``{"__array__": file, "key": key}`` reference of ``records``
    (totals and groups) by its value from ``<log>.arrays``; a file that cannot be read leaves
    its values None, with one warning."""
    cache: dict[str, Any] = {}
    missing: list[str] = []
    for record in records:
        for values in (record.values, *record.groups.values()):  # totals, then each group
            for key, value in values.items():
                if isinstance(value, dict) and set(value) == {"__array__", "key"}:
                    name = value["__array__"]
                    if name not in cache:
                        try:
                            cache[name] = torch.load(path.parent / name, weights_only=True)
                        except (OSError, RuntimeError, EOFError) as err:
                            cache[name] = None
                            missing.append(f"{name} ({type(err).__name__})")
                    data = cache[name]
                    values[key] = None if data is None else data.get(value["key"])
    if missing:
        warnings.warn(
            f"gradlens log {str(path)!r}: array file(s) {', '.join(missing)} could not be read; "
            "those values are None",
            UserWarning,
            stacklevel=3,
        )
