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

This module is where these names are imported from (``gradlens.sinks`` of gradlens 0.1 is it);
each is defined in the module of its concept:

- :mod:`gradlens.output.jsonl`: the writer, :class:`JsonlSink` (its lock, what a line keeps);
- :mod:`gradlens.output.log_format`: the log on disk (lines, segment headers, ``<log>.arrays``),
  shared by the writer and the reader;
- :mod:`gradlens.output.log_reader`: :func:`load_log`;
- :mod:`gradlens.output.tensorboard`: :class:`TensorBoardSink`;
- :mod:`gradlens.output.sink_set`: :class:`SinkSet`.
"""

from __future__ import annotations

from gradlens.output.jsonl import GROUP_QUANTILES, LOG_MODES, JsonlSink  # noqa: F401 - imported from here
from gradlens.output.log_format import SEGMENT_KEY, PathLike, arrays_dir  # noqa: F401 - imported from here
from gradlens.output.log_reader import load_log
from gradlens.output.sink_set import SinkSet
from gradlens.output.tensorboard import TensorBoardSink

__all__ = ["JsonlSink", "SinkSet", "TensorBoardSink", "load_log", "arrays_dir"]
