"""The JSON-lines log writer: :class:`JsonlSink`, with its lock (one writer per log) and what a
line keeps of each value (small by default: summaries of large tensors, per-group histogram
quantiles, full values in ``<log>.arrays`` on request).

The file's format (lines, segment headers, the arrays folder) is
:mod:`gradlens.output.log_format`; reading a log back is :func:`gradlens.output.log_reader.load_log`.
"""

from __future__ import annotations

import errno
import json
import math
import os
import time
import uuid
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from torch import Tensor

from gradlens.core.records import Hist1d, Hist2d, Record, TensorSummary, record_to_json
from gradlens.output.log_format import SEGMENT_KEY, PathLike, arrays_dir, ends_mid_line, last_run, last_step

__all__ = ["GROUP_QUANTILES", "LOG_MODES", "JsonlSink"]

#: how a :class:`JsonlSink` opens an existing log
LOG_MODES = ("append", "overwrite")


class JsonlSink:
    """Write each record as one line of JSON to ``path``.

    Every :meth:`write` appends one line (``json.dumps(record_to_json(record))`` plus ``"\\n"``)
    with unbuffered writes, so the file always holds every record written so far, and a run that
    is killed leaves at most its last line truncated (:func:`~gradlens.load_log` then warns and keeps the
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
      first of a log add ``-run<r>``), which :func:`~gradlens.load_log` reads back in place.

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
                last = last_step(self.path)
                self.next_step = None if last is None else last + 1
                self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115
                self._cut = ends_mid_line(self.path)  # a writer killed mid-line
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
        from step ``start`` (a Lens resumed from a checkpoint): :func:`~gradlens.load_log` then keeps,
        per step, the record of the latest segment. On an empty file nothing is written (a log
        of one run has no header line); otherwise a header line goes before the next record.
        """
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"JsonlSink.begin_segment(start={start!r}) must be a step, an int >= 0")
        latest, empty = last_run(self.path)
        if empty:
            self._run, self._header = 0, None
            return
        self._run = latest + 1 if start == 0 else latest
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
        if self._cut and ends_mid_line(self.path):
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


# --------------------------------------------------------------------------- one writer per log


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


# --------------------------------------------------------------------------- what a line keeps


def _is_big(value: Any, max_elements: int) -> bool:
    """Whether ``value`` is summarised in a line: a tensor of more than ``max_elements``
    elements, or a dict holding a tensor of at least one dimension (per-parameter values)."""
    if isinstance(value, Tensor):
        return value.numel() > max_elements
    if isinstance(value, Mapping):
        return any(isinstance(v, Tensor) and v.dim() > 0 for v in value.values())
    return False


def _summarise(value: Any, max_elements: int) -> Any:
    """A big value as a line keeps it: a tensor as its
    :class:`~gradlens.core.records.TensorSummary`, a dict with each tensor of >= 1 dimension so."""
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
    """``value`` (a tensor, or a dict of them) detached on the CPU, for ``<log>.arrays``."""
    if isinstance(value, Tensor):
        return value.detach().cpu()
    if isinstance(value, Mapping):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value
