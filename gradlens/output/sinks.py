"""Where records go: a JSON-lines log, TensorBoard, and reading a log back.

A *sink* is any object with ``write(record)`` and ``close()``; the :class:`~gradlens.Lens` calls
``write`` once per tracked window (in step order) and ``close`` once when it is closed.

- :class:`JsonlSink` writes one JSON object per line (:func:`gradlens.core.records.record_to_json`)
  and flushes after each line, so a log of a long run can be read while the run goes on.
- :class:`TensorBoardSink` writes scalars and histograms through a
  ``torch.utils.tensorboard.SummaryWriter``.
- :func:`load_log` reads a JSON-lines log back into :class:`~gradlens.Record` objects.
- :class:`SinkSet` is how a Lens writes to its sinks: a sink whose write fails (a full disk, a
  file-size limit, a network error) is reported and retried, never breaks the training loop.

A log may hold several *runs* (one per fresh Lens) and, within a run, several *segments* (one
per Lens: a run resumed from a checkpoint goes on in a new segment). A segment that starts on a
non-empty log begins with a header line ``{"__gradlens_segment__": 1, "run": r, "start": s,
...}``; :func:`load_log` reads the records of one run, where a segment that starts at step ``s``
replaces the records ``>= s`` of the segments before it.
"""

from __future__ import annotations

import errno
import json
import math
import os
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from torch import Tensor

from gradlens.core.records import (
    Hist1d, Hist2d, Record, TensorSummary, flatten, flatten_histograms, record_from_json, record_to_json,
)

__all__ = ["JsonlSink", "SinkSet", "TensorBoardSink", "load_log", "arrays_dir"]

PathLike = str | os.PathLike


# --------------------------------------------------------------------------- JSON lines


LOG_MODES = ("append", "overwrite")


class JsonlSink:
    """Write each record as one line of JSON to ``path``.

    Every :meth:`write` appends one line (``json.dumps(record_to_json(record))`` plus ``"\\n"``)
    with unbuffered writes, so the file always holds every record written so far, and a run that
    is killed leaves at most its last line truncated (:func:`load_log` then warns and keeps the
    rest). A write that fails part-way (a full disk, a file-size limit) leaves a cut line; the
    next write first ends that line, so a record is never glued to a cut one.

    One writer per file: the sink holds an exclusive ``fcntl.flock`` on the log from its
    creation to :meth:`close` (the system releases it when the process dies); a second sink on
    the same file, in this process or another, is refused with a ``RuntimeError``.

    What a line holds (small by default, so that a long run's log stays readable):

    - scalars, histograms and tensors of at most ``max_elements`` elements (``batch_l2`` [N],
      ``batch_dot`` [N, N] for small N) in full;
    - a per-parameter dict of tensors (``sum_grad_squared``) and any larger tensor as a
      :class:`~gradlens.core.records.TensorSummary` (shape, dtype, sum, L2 norm, min, max): a
      ResNet-18's record is a few KB instead of ~100 MB;
    - each group of ``record.groups`` by the same rules, key by key (its ``full`` values under
      ``"groups/<group>/<key>"`` in the binary file);
    - the values of the keys in ``full`` in full, in a binary file next to the log
      (``<log>.arrays/step-<step>.pt``, ``torch.save`` of a dict key -> value; runs after the
      first of a log add ``-run<r>``), which :func:`load_log` reads back in place.

    Args:
        path: the log file; missing parent folders are created.
        mode: ``"append"`` (default) adds lines after the existing ones (a last line cut by a
            killed writer is ended first, so the new record starts on a fresh line);
            ``"overwrite"`` starts a new file (and removes the old ``.pt`` files of
            ``<log>.arrays``).
        append: the older spelling: ``True`` is ``mode="append"``, ``False`` ``mode="overwrite"``.
        keys: record keys to write (``None``: all); ``step``, ``num_samples`` and
            ``micro_steps`` are always written.
        full: record keys whose values go in full to the binary file (``True``: every value
            that would otherwise be summarised).
        max_elements: the largest tensor written inline in full.

    Attributes:
        next_step: on ``mode="append"``, the step after the last complete record already in
            the file (``None`` for a new or empty file).

    Raises:
        RuntimeError: another sink (another Lens, another process) is writing ``path``.

    Also a context manager: ``with JsonlSink(path) as sink: ...`` closes it on exit.
    """

    def __init__(
        self,
        path: PathLike,
        *,
        mode: str = "append",
        append: bool | None = None,
        keys: Iterable[str] | None = None,
        full: Iterable[str] | bool = (),
        max_elements: int = 4096,
    ) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(
                f"JsonlSink(path=...) needs a file path (str or os.PathLike), got "
                f"{type(path).__name__} {path!r}"
            )
        if append is not None:
            mode = "append" if append else "overwrite"
        if mode not in LOG_MODES:
            raise ValueError(f"JsonlSink(mode={mode!r}): use one of {LOG_MODES}")
        if isinstance(keys, str) or isinstance(full, str):
            raise TypeError("JsonlSink(keys=..., full=...) take lists of record keys, not a string")
        if isinstance(max_elements, bool) or not isinstance(max_elements, int) or max_elements < 0:
            raise ValueError(f"JsonlSink(max_elements={max_elements!r}) must be an int >= 0")
        self.path = Path(path)
        if self.path.is_dir():
            raise IsADirectoryError(
                f"JsonlSink(path={str(self.path)!r}) is a folder; give a file path such as "
                f"{str(self.path / 'log.jsonl')!r}"
            )
        self.mode = mode
        self.keys = None if keys is None else frozenset(keys)
        self.full = full if isinstance(full, bool) else frozenset(full)
        self.max_elements = max_elements
        self.arrays_dir = arrays_dir(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.next_step: int | None = None
        self._lock = _lock_log(self.path)  # before anything is truncated; released on close
        self._header: bytes | None = None  # a segment header waiting for the first record
        self._run = 0
        try:
            if mode == "overwrite":
                if self.arrays_dir.is_dir():
                    for old in self.arrays_dir.glob("step-*.pt"):
                        old.unlink()
                self._file = open(self.path, "wb", buffering=0)  # noqa: SIM115
                self._cut = False
            else:
                last = _last_step(self.path)
                self.next_step = None if last is None else last + 1
                self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115
                self._cut = _ends_mid_line(self.path)  # a writer killed mid-line
        except BaseException:
            self._lock.close()
            raise

    @property
    def closed(self) -> bool:
        return self._file.closed

    def begin_segment(self, start: int) -> None:
        """Mark the records written from now on as a new segment starting at step ``start``
        (a :class:`~gradlens.Lens` calls this before its first record).

        ``start == 0`` is a new run (a fresh Lens); ``start > 0`` continues the log's last run
        from step ``start`` (a Lens resumed from a checkpoint): :func:`load_log` then keeps,
        per step, the record of the latest segment. On an empty file nothing is written (a log
        of one run has no header line); otherwise a header line goes before the next record.
        """
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"JsonlSink.begin_segment(start={start!r}) must be a step, an int >= 0")
        last_run, empty = _last_run(self.path)
        if empty:
            self._run, self._header = 0, None
            return
        self._run = last_run + 1 if start == 0 else last_run
        header = {
            SEGMENT_KEY: 1,
            "run": self._run,
            "start": start,
            "id": uuid.uuid4().hex,
            "pid": os.getpid(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        self._header = (json.dumps(header, separators=(",", ":")) + "\n").encode()

    def _array_name(self, step: int) -> str:
        run = f"-run{self._run}" if self._run else ""
        return f"step-{step:08d}{run}.pt"

    def _shrink(self, record: Record) -> Record:
        """The record as it goes into the log: selected keys, summaries, array references
        (the same rules for the totals and for each group of ``record.groups``)."""
        arrays: dict[str, Any] = {}
        name = self._array_name(record.step)

        def shrink(items, prefix: str) -> dict[str, Any]:
            values = {}
            for key, value in items:
                if self.keys is not None and key not in self.keys:
                    continue
                full = self.full is True or (self.full is not True and key in self.full)
                big = _is_big(value, self.max_elements)
                if big and full:
                    arrays[prefix + key] = _to_cpu(value)
                    values[key] = {"__array__": f"{self.arrays_dir.name}/{name}", "key": prefix + key}
                elif prefix and not full and isinstance(value, (Hist1d, Hist2d)) and value.counts.numel() > self.max_elements:
                    # per group, a histogram of more than max_elements bins as scalar summaries
                    # (a GPT-2 record has ~75 groups)
                    values[key] = _group_summary(value, self.max_elements)
                elif big:
                    values[key] = _summarise(value, self.max_elements)
                else:
                    values[key] = value
            return values

        values = shrink(record.values.items(), "")
        # a group's arrays are stored under "groups/<group>/<key>" (record keys have no "/")
        groups = {g: shrink(v.items(), f"groups/{g}/") for g, v in record.groups.items()}
        if arrays:
            self.arrays_dir.mkdir(parents=True, exist_ok=True)
            target = self.arrays_dir / name
            tmp = target.with_suffix(".tmp")
            try:
                torch.save(arrays, tmp)
                os.replace(tmp, target)  # the line below never points at a half-written file
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        return Record(record.step, record.num_samples, record.micro_steps, values, record.meta, groups)

    def write(self, record: Record) -> None:
        """Append ``record`` as one JSON line (after a segment header, if one is waiting).

        Raises:
            TypeError: ``record`` is not a :class:`~gradlens.Record`, or one of its values
                cannot be written as JSON.
            ValueError: the sink is closed.
            OSError: the file or the array file could not be written (the sink stays usable:
                the next write ends a cut line first).
        """
        if not isinstance(record, Record):
            raise TypeError(
                f"JsonlSink.write(record=...) needs a gradlens Record, got {type(record).__name__}"
            )
        if self._file.closed:
            raise ValueError(f"JsonlSink for {str(self.path)!r} is closed; open a new sink to write")
        shrunk = self._shrink(record)
        try:
            line = json.dumps(record_to_json(shrunk), allow_nan=False, separators=(",", ":"))
        except (TypeError, ValueError) as err:
            raise TypeError(
                f"record of step {record.step} cannot be written as JSON ({err}); values must be "
                "tensors, numbers, strings, Hist1d/Hist2d, or lists/dicts of those"
            ) from err
        data = (self._header or b"") + line.encode("utf-8") + b"\n"
        if self._cut and _ends_mid_line(self.path):
            data = b"\n" + data  # end the line a failed or killed write cut
        self._cut = True  # until the whole line is in the file
        view = memoryview(data)
        while view:
            n = self._file.write(view)
            if not n:
                raise OSError(errno.EIO, f"no byte of the record of step {record.step} was written", str(self.path))
            view = view[n:]
        self._cut = False
        self._header = None

    def close(self) -> None:
        """Close the file and release the lock. Closing twice is harmless."""
        if not self._file.closed:
            try:
                self._file.close()
            finally:
                self._lock.close()

    def __enter__(self) -> JsonlSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"JsonlSink({str(self.path)!r}, {state})"


SEGMENT_KEY = "__gradlens_segment__"


def _lock_log(path: Path) -> Any:
    """``path`` (created if missing) opened and holding an exclusive flock, or a RuntimeError.
    The lock goes with the returned file object: released when it is closed (or collected) and
    when the process dies."""
    lock = open(os.open(path, os.O_RDONLY | os.O_CREAT, 0o644), "rb", buffering=0)  # noqa: SIM115
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not a POSIX system: no lock
        return lock
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        lock.close()
        if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        raise RuntimeError(
            f"log {str(path)!r} is being written by another Lens or JsonlSink (in this or "
            "another process, which holds its lock); close that one first (lens.close()), or "
            "give this run its own log path, e.g. Lens(..., log='run-2.jsonl')"
        ) from None
    return lock


def arrays_dir(log_path: PathLike) -> Path:
    """The folder next to a log that holds its full tensors: ``<log>.arrays``."""
    log_path = Path(log_path)
    return log_path.with_name(log_path.name + ".arrays")


def _is_big(value: Any, max_elements: int) -> bool:
    if isinstance(value, Tensor):
        return value.numel() > max_elements
    if isinstance(value, Mapping):
        return any(isinstance(v, Tensor) and v.dim() > 0 for v in value.values())
    return False


def _summarise(value: Any, max_elements: int) -> Any:
    if isinstance(value, Tensor):
        return TensorSummary.of(value)
    return {
        k: TensorSummary.of(v) if isinstance(v, Tensor) and v.dim() > 0 else v
        for k, v in value.items()
    }


#: the quantiles of a group's histogram written to the log
GROUP_QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


def _group_summary(value: Any, max_elements: int) -> Any:
    """A per-group value as the log keeps it: tensors as for the totals (:func:`_summarise`),
    a histogram as a dict of scalars (``total``, the clamped counts and ``clamped_fraction``,
    quantiles ``q05`` ... ``q95`` of the gradient axis, interpolated linearly within a bin);
    the full group histograms are in the records in memory and the TensorBoard / W&B sinks."""
    if isinstance(value, Hist1d):
        clamped = {"clamped_low": value.clamped_low, "clamped_high": value.clamped_high}
        counts, edges = value.counts, value.edges
    elif isinstance(value, Hist2d):
        clamped = {"clamped_param": value.clamped_param, "clamped_grad": value.clamped_grad}
        counts, edges = value.counts.sum(0), value.grad_edges
    elif _is_big(value, max_elements):
        return _summarise(value, max_elements)
    else:
        return value
    counts = counts.detach().double().cpu()
    total = float(counts.sum())
    out = {"total": total, **clamped}
    out["clamped_fraction"] = float(sum(clamped.values())) / total if total else math.nan
    cdf = counts.cumsum(0)
    edges = edges.detach().double().cpu()
    for q in GROUP_QUANTILES:
        key = f"q{round(100 * q):02d}"
        if not total:
            out[key] = math.nan
            continue
        i = min(int(torch.searchsorted(cdf, q * total)), len(counts) - 1)
        before = float(cdf[i - 1]) if i else 0.0
        inside = (q * total - before) / float(counts[i]) if float(counts[i]) else 0.0
        out[key] = float(edges[i] + inside * (edges[i + 1] - edges[i]))
    return out


def _to_cpu(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().cpu()
    if isinstance(value, Mapping):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def _ends_mid_line(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                return False
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"
    except FileNotFoundError:
        return False


def _last_step(path: Path, tail_bytes: int = 1 << 22) -> int | None:
    """The step of the last complete record of a log (reads only its tail), or None."""
    if not path.is_file():
        return None
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        while True:
            start = max(0, size - tail_bytes)
            f.seek(start)
            lines = f.read().split(b"\n")
            if start > 0:
                lines = lines[1:]  # the first line of a tail may be cut
            for raw in reversed(lines):
                if raw.strip():
                    try:
                        return _parse_line(raw).step
                    except _CorruptLine:
                        continue
            if start == 0:
                return None
            tail_bytes *= 4


def _last_run(path: Path, chunk: int = 1 << 22) -> tuple[int, bool]:
    """``(run of the log's last segment header, whether the log has no content)``; a log without
    headers is run 0. Reads backwards from the end until a header is found."""
    if not path.is_file():
        return 0, True
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        end = f.tell()
        pos, carry, content = end, b"", False
        while pos > 0:
            start = max(0, pos - chunk)
            f.seek(start)
            block = f.read(pos - start) + carry
            lines = block.split(b"\n")
            carry = lines[0] if start > 0 else b""  # may be cut: joined with the next block
            for raw in reversed(lines[1:] if start > 0 else lines):
                if not raw.strip():
                    continue
                content = True
                header = _parse_header(raw)
                if header is not None:
                    return int(header["run"]), False
            pos = start
        return 0, not content


def _parse_header(raw: bytes) -> dict | None:
    """A segment header line as a dict, or None when ``raw`` is not one."""
    if not raw.lstrip().startswith(b'{"' + SEGMENT_KEY.encode()):
        return None
    try:
        data = json.loads(raw.decode("utf-8"))
        run, start = data["run"], data["start"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        return None
    if not (isinstance(run, int) and isinstance(start, int)):
        return None
    return data


def load_log(path: PathLike, *, arrays: bool = True, run: int | str = -1) -> list[Record]:
    """Read a JSON-lines log written by :class:`JsonlSink` into a list of records.

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
        header = _parse_header(raw)
        if header is not None:
            current = header["run"]
            start = header["start"]
            runs[current] = [r for r in runs.get(current, []) if r.step < start]
            continue
        try:
            record = _parse_line(raw)
        except _CorruptLine as err:
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


class _CorruptLine(Exception):
    pass


def _parse_line(raw: bytes) -> Record:
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise _CorruptLine("not UTF-8 text") from None
    except json.JSONDecodeError as err:
        raise _CorruptLine(f"invalid JSON: {err.msg} at column {err.colno}") from None
    if not isinstance(data, dict):
        raise _CorruptLine(f"expected a JSON object, got {type(data).__name__}")
    try:
        return record_from_json(data)
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as err:
        raise _CorruptLine(f"not a gradlens record: {err}") from None


# --------------------------------------------------------------------------- the Lens's sinks


class SinkSet(list):
    """The sinks of a :class:`~gradlens.Lens`, written so that a failing sink never breaks it.

    :meth:`write` gives a record to every sink. A sink whose ``write`` raises (a full disk, a
    file-size limit, an ``.arrays`` folder that cannot be created, a network error) does not stop
    the Lens: the window still closes and the step advances. The first failure is reported by
    one ``RuntimeWarning`` naming the sink and the error; the records it could not take (at most
    ``max_failures``) are held and written again, in order, before the next record; after
    ``max_failures`` failed writes in a row the sink is closed and dropped, with a warning that
    names the steps it lost. A sink that recovers writes what it held and goes on; :meth:`close`
    tries what a sink still holds once more before closing it.

    Attributes:
        first_window: the first window index the Lens closed (set by the Lens); a sink with
            ``begin_segment`` (:class:`JsonlSink`) starts its segment at the lower of it and
            the first record's step (a resumed Lens may write a record of the window before).
        dropped: ``(sink, error)`` of the sinks given up.
    """

    max_failures = 3

    def __init__(self, sinks: Iterable[Any] = ()) -> None:
        super().__init__(sinks)
        self.first_window: int | None = None
        self.dropped: list[tuple[Any, BaseException]] = []
        self._held: dict[int, list[Record]] = {}  # id(sink) -> records it failed to take
        self._failures: dict[int, int] = {}  # id(sink) -> failed writes in a row
        self._begun: set[int] = set()

    def write(self, record: Record) -> None:
        """Write ``record`` to every sink (after what a sink still holds)."""
        for sink in list(self):
            key = id(sink)
            queue = self._held.pop(key, []) + [record]
            for n, r in enumerate(queue):
                try:
                    if key not in self._begun:
                        begin = getattr(sink, "begin_segment", None)
                        if begin is not None:
                            first = r.step if self.first_window is None else min(self.first_window, r.step)
                            begin(first)
                        self._begun.add(key)
                    sink.write(r)
                except Exception as err:  # noqa: BLE001 - any sink error is reported, not raised
                    self._failed(sink, err, queue[n:])
                    break
            else:
                self._failures.pop(key, None)

    def _failed(self, sink: Any, err: Exception, unwritten: list[Record]) -> None:
        key = id(sink)
        failures = self._failures.get(key, 0) + 1
        self._failures[key] = failures
        what = f"{type(err).__name__}: {err}"
        if failures >= self.max_failures:
            self.remove(sink)
            self._failures.pop(key, None)
            self._begun.discard(key)
            self.dropped.append((sink, err))
            try:
                sink.close()
            except Exception:  # noqa: BLE001 - closing a broken sink may fail again
                pass
            steps = [r.step for r in unwritten]
            warnings.warn(
                f"gradlens dropped the sink {sink!r} after {failures} failed writes in a row "
                f"(last: {what}); the records of steps {steps} were not written to it, and no "
                "later record will be. The Lens and its other sinks go on; fix the cause (disk "
                "space, permissions) and give a new sink to a new Lens",
                RuntimeWarning,
                stacklevel=4,
            )
            return
        kept = unwritten[-self.max_failures :]
        lost = [r.step for r in unwritten[: len(unwritten) - len(kept)]]
        self._held[key] = kept
        if failures == 1:
            warnings.warn(
                f"gradlens could not write the record of step {unwritten[0].step} to the sink "
                f"{sink!r} ({what}); training and the Lens go on (the window closed, the step "
                f"advanced). The sink is tried again, with the records it missed, at the next "
                f"record, and dropped after {self.max_failures} failed writes in a row"
                + (f"; records of steps {lost} are lost for it" if lost else ""),
                RuntimeWarning,
                stacklevel=4,
            )

    def close(self) -> None:
        """Write what a sink still holds (once more), then close every sink; a sink that fails
        either way is reported, the others still close."""
        for sink in list(self):
            held = self._held.pop(id(sink), [])
            for n, r in enumerate(held):
                try:
                    sink.write(r)
                except Exception as err:  # noqa: BLE001
                    warnings.warn(
                        f"gradlens could not write the records of steps {[q.step for q in held[n:]]} "
                        f"to the sink {sink!r} before closing it ({type(err).__name__}: {err}); "
                        "they are lost for it",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                    break
            try:
                sink.close()
            except Exception as err:  # noqa: BLE001
                warnings.warn(
                    f"gradlens could not close the sink {sink!r} ({type(err).__name__}: {err})",
                    RuntimeWarning,
                    stacklevel=3,
                )
        self._held.clear()


# --------------------------------------------------------------------------- TensorBoard


class TensorBoardSink:
    """Write records to TensorBoard, at ``global_step = record.step``.

    What is written, per record:

    - a scalar ``gradlens/<key>`` for every value that is a real number or a 0-d tensor
      (``gradlens/loss``, ``gradlens/grad_norm``, ``gradlens/noise_scale``, ...), and
      ``gradlens/<key>/<name>`` for such numbers inside dict values (e.g. per-parameter);
    - for a :class:`~gradlens.Hist1d` under ``key``: a histogram ``gradlens/<key>`` built with
      ``SummaryWriter.add_histogram_raw`` from the record's own counts and edges (no re-binning
      of samples), plus scalars ``gradlens/<key>/clamped_low`` and ``.../clamped_high``;
    - for a :class:`~gradlens.Hist2d`: its two marginals as histograms
      ``gradlens/<key>/grad`` and ``gradlens/<key>/param`` (TensorBoard has no 2D histogram),
      plus scalars ``gradlens/<key>/clamped_param`` and ``.../clamped_grad``.

    The names are those of :func:`gradlens.core.records.flatten` and
    :func:`gradlens.core.records.flatten_histograms`, as for every other sink and logger.

    TensorBoard's histogram summary also wants min, max, sum and sum of squares of the samples;
    gradlens keeps only counts, so min/max are the outer edges of the first/last non-empty bins
    and sum/sum of squares are computed from bin centres (approximate; they only affect
    TensorBoard's tooltips, not the drawn histogram).

    Args:
        writer_or_logdir: a ``SummaryWriter`` (left open by :meth:`close`, only flushed), or a
            log folder for a new ``SummaryWriter`` that this sink owns and closes.

    Raises:
        ImportError: TensorBoard is not installed (``pip install tensorboard``).
    """

    def __init__(self, writer_or_logdir: Any) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError(
                "TensorBoardSink needs the tensorboard package: pip install tensorboard"
            ) from err
        if isinstance(writer_or_logdir, (str, os.PathLike)):
            self.writer = SummaryWriter(log_dir=str(writer_or_logdir))
            self._owns_writer = True
        elif hasattr(writer_or_logdir, "add_scalar") and hasattr(
            writer_or_logdir, "add_histogram_raw"
        ):
            self.writer = writer_or_logdir
            self._owns_writer = False
        else:
            raise TypeError(
                "TensorBoardSink(writer_or_logdir=...) needs a torch.utils.tensorboard "
                f"SummaryWriter or a log folder path, got {type(writer_or_logdir).__name__}"
            )
        self._closed = False

    def write(self, record: Record) -> None:
        """Write the scalars and histograms of ``record`` at step ``record.step``."""
        if not isinstance(record, Record):
            raise TypeError(
                "TensorBoardSink.write(record=...) needs a gradlens Record, got "
                f"{type(record).__name__}"
            )
        if self._closed:
            raise ValueError("TensorBoardSink is closed; open a new sink to write")
        step = record.step
        for tag, (counts, edges) in flatten_histograms(record, who="TensorBoardSink.write").items():
            self._histogram(tag, counts, edges, step)
        for tag, number in flatten(record, who="TensorBoardSink.write").items():
            self.writer.add_scalar(tag, number, step)

    def _histogram(self, tag: str, counts: Tensor, edges: Tensor, step: int) -> None:
        counts = counts.detach().cpu().to(torch.float64)
        edges = edges.detach().cpu().to(torch.float64)
        num = float(counts.sum())
        if num <= 0:
            return  # TensorBoard cannot show an empty histogram
        nonzero = torch.nonzero(counts).flatten()
        lo_bin, hi_bin = int(nonzero[0]), int(nonzero[-1])
        centres = 0.5 * (edges[:-1] + edges[1:])
        # TensorBoard buckets are (previous limit, limit]; a leading empty bucket whose limit is
        # the first edge keeps the left edge of the range.
        self.writer.add_histogram_raw(
            tag,
            min=float(edges[lo_bin]),
            max=float(edges[hi_bin + 1]),
            num=num,
            sum=float((counts * centres).sum()),
            sum_squares=float((counts * centres**2).sum()),
            bucket_limits=edges.tolist(),
            bucket_counts=[0.0] + counts.tolist(),
            global_step=step,
        )

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        """Flush; close the writer if this sink created it. Closing twice is harmless."""
        if self._closed:
            return
        self._closed = True
        if self._owns_writer:
            self.writer.close()
        else:
            self.writer.flush()

    def __enter__(self) -> TensorBoardSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
