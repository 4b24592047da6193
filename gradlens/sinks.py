"""Where records go: a JSON-lines log, TensorBoard, and reading a log back.

A *sink* is any object with ``write(record)`` and ``close()``; the :class:`~gradlens.Lens` calls
``write`` once per tracked window (in step order) and ``close`` once when it is closed.

- :class:`JsonlSink` writes one JSON object per line (:func:`gradlens.records.record_to_json`)
  and flushes after each line, so a log of a long run can be read while the run goes on.
- :class:`TensorBoardSink` writes scalars and histograms through a
  ``torch.utils.tensorboard.SummaryWriter``.
- :func:`load_log` reads a JSON-lines log back into :class:`~gradlens.Record` objects.
"""

from __future__ import annotations

import json
import numbers
import os
import warnings
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import Tensor

from gradlens.records import Hist1d, Hist2d, Record, record_from_json, record_to_json

__all__ = ["JsonlSink", "TensorBoardSink", "load_log"]

PathLike = str | os.PathLike


# --------------------------------------------------------------------------- JSON lines


class JsonlSink:
    """Write each record as one line of JSON to ``path``.

    Every :meth:`write` appends one line (``json.dumps(record_to_json(record))`` plus ``"\\n"``)
    and flushes it, so the file always holds every record written so far, and a run that is
    killed leaves at most its last line truncated (:func:`load_log` then warns and keeps the rest).

    Args:
        path: the log file; missing parent folders are created.
        append: ``False`` (default) starts a new file, replacing an old one; ``True`` adds lines
            after the existing ones (e.g. resuming a run).

    Also a context manager: ``with JsonlSink(path) as sink: ...`` closes it on exit.
    """

    def __init__(self, path: PathLike, *, append: bool = False) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(
                f"JsonlSink(path=...) needs a file path (str or os.PathLike), got "
                f"{type(path).__name__} {path!r}"
            )
        self.path = Path(path)
        if self.path.is_dir():
            raise IsADirectoryError(
                f"JsonlSink(path={str(self.path)!r}) is a folder; give a file path such as "
                f"{str(self.path / 'log.jsonl')!r}"
            )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a" if append else "w", encoding="utf-8")  # noqa: SIM115

    @property
    def closed(self) -> bool:
        return self._file.closed

    def write(self, record: Record) -> None:
        """Append ``record`` as one JSON line and flush it to the file.

        Raises:
            TypeError: ``record`` is not a :class:`~gradlens.Record`, or one of its values
                cannot be written as JSON.
            ValueError: the sink is closed.
        """
        if not isinstance(record, Record):
            raise TypeError(
                f"JsonlSink.write(record=...) needs a gradlens Record, got {type(record).__name__}"
            )
        if self._file.closed:
            raise ValueError(f"JsonlSink for {str(self.path)!r} is closed; open a new sink to write")
        try:
            line = json.dumps(record_to_json(record), allow_nan=False, separators=(",", ":"))
        except (TypeError, ValueError) as err:
            raise TypeError(
                f"record of step {record.step} cannot be written as JSON ({err}); values must be "
                "tensors, numbers, strings, Hist1d/Hist2d, or lists/dicts of those"
            ) from err
        self._file.write(line + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file. Closing twice is harmless."""
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> JsonlSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"JsonlSink({str(self.path)!r}, {state})"


def load_log(path: PathLike) -> list[Record]:
    """Read a JSON-lines log written by :class:`JsonlSink` into a list of records (file order).

    Blank lines are skipped. A log whose *last* line is truncated or corrupt (a run killed while
    writing) is still read: the intact records are returned and a :class:`UserWarning` names
    the file and the line number that was dropped.

    Raises:
        FileNotFoundError: ``path`` does not exist (the message gives the path).
        ValueError: a line other than the last is not a gradlens record (the message gives the
            file and the line number).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"gradlens log not found: {str(path)!r}")
    if path.is_dir():
        raise IsADirectoryError(f"gradlens log {str(path)!r} is a folder, not a .jsonl file")
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    records: list[Record] = []
    for pos, (lineno, raw) in enumerate(numbered):
        try:
            records.append(_parse_line(raw))
        except _CorruptLine as err:
            where = f"{str(path)!r} line {lineno}"
            if pos == len(numbered) - 1:
                warnings.warn(
                    f"gradlens log {where} is truncated or corrupt ({err}); it was skipped and "
                    f"the {len(records)} records before it were loaded",
                    UserWarning,
                    stacklevel=2,
                )
                break
            raise ValueError(
                f"gradlens log {where} is corrupt ({err}); only a truncated last line can be "
                "skipped"
            ) from None
    return records


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
      ``gradlens/<key>/grad`` and ``gradlens/<key>/param`` (TensorBoard has no 2D histogram).

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
        for key, value in record.items():
            tag = f"gradlens/{key}"
            if isinstance(value, Hist1d):
                self._histogram(tag, value.counts, value.edges, step)
                self.writer.add_scalar(f"{tag}/clamped_low", value.clamped_low, step)
                self.writer.add_scalar(f"{tag}/clamped_high", value.clamped_high, step)
            elif isinstance(value, Hist2d):
                counts = value.counts.to(torch.float64)
                self._histogram(f"{tag}/grad", counts.sum(0), value.grad_edges, step)
                self._histogram(f"{tag}/param", counts.sum(1), value.param_edges, step)
            elif isinstance(value, Mapping):
                for name, inner in value.items():
                    number = _as_number(inner)
                    if number is not None:
                        self.writer.add_scalar(f"{tag}/{name}", number, step)
            else:
                number = _as_number(value)
                if number is not None:
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


def _as_number(value: Any) -> float | None:
    """``value`` as a float when it is a real number or a 0-d real tensor, else ``None``."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    if (
        isinstance(value, Tensor)
        and value.dim() == 0
        and not value.is_complex()
        and value.dtype != torch.bool
    ):
        return float(value)
    return None

