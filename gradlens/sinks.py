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
from typing import Any, Iterable, Mapping

import torch
from torch import Tensor

from gradlens.records import Hist1d, Hist2d, Record, TensorSummary, record_from_json, record_to_json

__all__ = ["JsonlSink", "TensorBoardSink", "load_log", "arrays_dir"]

PathLike = str | os.PathLike


# --------------------------------------------------------------------------- JSON lines


LOG_MODES = ("append", "overwrite")


class JsonlSink:
    """Write each record as one line of JSON to ``path``.

    Every :meth:`write` appends one line (``json.dumps(record_to_json(record))`` plus ``"\\n"``)
    and flushes it, so the file always holds every record written so far, and a run that is
    killed leaves at most its last line truncated (:func:`load_log` then warns and keeps the rest).

    What a line holds (small by default, so that a long run's log stays readable):

    - scalars, histograms and tensors of at most ``max_elements`` elements (``batch_l2`` [N],
      ``batch_dot`` [N, N] for small N) in full;
    - a per-parameter dict of tensors (``sum_grad_squared``) and any larger tensor as a
      :class:`~gradlens.records.TensorSummary` (shape, dtype, sum, L2 norm, min, max): a
      ResNet-18's record is a few KB instead of ~100 MB;
    - each group of ``record.groups`` by the same rules, key by key (its ``full`` values under
      ``"groups/<group>/<key>"`` in the binary file);
    - the values of the keys in ``full`` in full, in a binary file next to the log
      (``<log>.arrays/step-<step>.pt``, ``torch.save`` of a dict key -> value), which
      :func:`load_log` reads back in place.

    Args:
        path: the log file; missing parent folders are created.
        mode: ``"append"`` (default) adds lines after the existing ones (a restarted run keeps
            its old records; a last line cut by a killed writer is ended first, so the new
            record starts on a fresh line); ``"overwrite"`` starts a new file (and removes the
            old ``.pt`` files of ``<log>.arrays``).
        append: the older spelling: ``True`` is ``mode="append"``, ``False`` ``mode="overwrite"``.
        keys: record keys to write (``None``: all); ``step``, ``num_samples`` and
            ``micro_steps`` are always written.
        full: record keys whose values go in full to the binary file (``True``: every value
            that would otherwise be summarised).
        max_elements: the largest tensor written inline in full.

    Attributes:
        next_step: on ``mode="append"``, the step after the last complete record already in
            the file (``None`` for a new or empty file); :class:`~gradlens.Lens` continues
            counting from it (``log_mode="resume"``).

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
        if mode == "overwrite":
            if self.arrays_dir.is_dir():
                for old in self.arrays_dir.glob("step-*.pt"):
                    old.unlink()
            self._file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115
        else:
            last = _last_step(self.path)
            self.next_step = None if last is None else last + 1
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
            if _ends_mid_line(self.path):
                self._file.write("\n")  # a writer killed mid-line: start on a fresh line
                self._file.flush()

    @property
    def closed(self) -> bool:
        return self._file.closed

    def _shrink(self, record: Record) -> Record:
        """The record as it goes into the log: selected keys, summaries, array references
        (the same rules for the totals and for each group of ``record.groups``)."""
        arrays: dict[str, Any] = {}

        def shrink(items, prefix: str) -> dict[str, Any]:
            values = {}
            for key, value in items:
                if self.keys is not None and key not in self.keys:
                    continue
                big = _is_big(value, self.max_elements)
                if big and (self.full is True or (self.full is not True and key in self.full)):
                    arrays[prefix + key] = _to_cpu(value)
                    values[key] = {"__array__": f"{self.arrays_dir.name}/step-{record.step:08d}.pt", "key": prefix + key}
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
            target = self.arrays_dir / f"step-{record.step:08d}.pt"
            tmp = target.with_suffix(".tmp")
            torch.save(arrays, tmp)
            os.replace(tmp, target)  # the line below never points at a half-written file
        return Record(record.step, record.num_samples, record.micro_steps, values, record.meta, groups)

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
            line = json.dumps(record_to_json(self._shrink(record)), allow_nan=False, separators=(",", ":"))
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


def load_log(path: PathLike, *, arrays: bool = True) -> list[Record]:
    """Read a JSON-lines log written by :class:`JsonlSink` into a list of records (file order).

    Blank lines are skipped. Damaged lines anywhere in the file (a run killed while writing, a
    line glued to a cut one by an older writer, a corrupt disk block) are skipped: every complete
    record is returned and one :class:`UserWarning` names the file and the line numbers dropped.
    Values written in full next to the log (``JsonlSink(full=...)``) are read back from
    ``<log>.arrays`` when ``arrays`` is True (a missing file leaves the value ``None``, with a
    warning); with ``arrays=False`` they stay ``{"__array__": file, "key": key}`` references.
    ``record.groups`` is restored like the totals (the same summaries and array references).

    Raises:
        FileNotFoundError: ``path`` does not exist (the message gives the path).
        ValueError: no line of a non-empty file is a gradlens record.
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
    bad: list[tuple[int, str]] = []
    for lineno, raw in numbered:
        try:
            records.append(_parse_line(raw))
        except _CorruptLine as err:
            bad.append((lineno, str(err)))
    if bad and not records:
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
            f"{shown}{more}; the {len(records)} complete records were loaded",
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

