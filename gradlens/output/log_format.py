"""A gradlens log on disk, as its writer (:class:`~gradlens.output.jsonl.JsonlSink`) and its
reader (:func:`~gradlens.output.log_reader.load_log`) both see it.

A log is a JSON-lines file: one :class:`~gradlens.Record` per line
(:func:`gradlens.core.records.record_to_json`), and, where a segment starts on a non-empty log, a
header line ``{"__gradlens_segment__": 1, "run": r, "start": s, ...}`` (:data:`SEGMENT_KEY`).
Values written in full live next to it in ``<log>.arrays`` (:func:`arrays_dir`). A line cut by a
killed or failed write is a :class:`CorruptLine` to the reader; the writer reads only the log's
tail (:func:`last_step`, :func:`last_run`, :func:`ends_mid_line`) to append to it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from gradlens.core.records import Record, record_from_json

__all__ = [
    "SEGMENT_KEY", "CorruptLine", "PathLike", "arrays_dir", "ends_mid_line", "last_run", "last_step",
    "parse_header", "parse_line",
]

PathLike = str | os.PathLike

#: the first key of a segment header line
SEGMENT_KEY = "__gradlens_segment__"


def arrays_dir(log_path: PathLike) -> Path:
    """The folder next to a log that holds its full tensors: ``<log>.arrays``."""
    log_path = Path(log_path)
    return log_path.with_name(log_path.name + ".arrays")


def ends_mid_line(path: Path) -> bool:
    """Whether the file ``path`` ends inside a line (no final newline: a cut write); False for
    a missing or empty file."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                return False
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"
    except FileNotFoundError:
        return False


def last_step(path: Path, tail_bytes: int = 1 << 22) -> int | None:
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
                        return parse_line(raw).step
                    except CorruptLine:
                        continue
            if start == 0:
                return None
            tail_bytes *= 4


def last_run(path: Path, chunk: int = 1 << 22) -> tuple[int, bool]:
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
                header = parse_header(raw)
                if header is not None:
                    return int(header["run"]), False
            pos = start
        return 0, not content


def parse_header(raw: bytes) -> dict | None:
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


class CorruptLine(Exception):
    """A line of a log that is not a gradlens record (cut, not UTF-8, not JSON, not a record);
    its message says which."""


def parse_line(raw: bytes) -> Record:
    """The record of one log line (bytes, without its newline); raises :class:`CorruptLine` when
    the line is not one."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise CorruptLine("not UTF-8 text") from None
    except json.JSONDecodeError as err:
        raise CorruptLine(f"invalid JSON: {err.msg} at column {err.colno}") from None
    if not isinstance(data, dict):
        raise CorruptLine(f"expected a JSON object, got {type(data).__name__}")
    try:
        return record_from_json(data)
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as err:
        text = str(err)
        raise CorruptLine(text if text.startswith("not a gradlens record") else f"not a gradlens record: {text}") from None
